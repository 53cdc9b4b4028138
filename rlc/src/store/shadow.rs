//! Controller reports in the store at fleet scale.
//!
//! Two tables: `shadow_reports` keeps every report (one row per controller tick, bucket and
//! scope key) for `store.shadow_raw_retention` (48 h by default), and `shadow_minutes` rolls
//! them up per minute per (service, bucket, scope key) for `store.shadow_rollup_retention`
//! (35 days by default). Ingest writes both in one transaction (the roll-up counts only the
//! reports that were new, so a re-delivered page is not counted twice); every dashboard query
//! and [`Store::shadow_stats`] read the roll-ups only.
//!
//! Time columns are real timestamps: `TIMESTAMPTZ` in Postgres, integer unix milliseconds in
//! SQLite. [`Ts`] binds and reads either, so both backends run the same query text.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use chrono::{DateTime, Duration, DurationRound, TimeZone, Utc};
use serde::{Deserialize, Serialize};
use sqlx::{Postgres, Sqlite};

use super::{Store, StoreError, StoredReport};
use grl_wire::{ReportRow, Tick};
use rlc_plan::readiness::{self, ShadowStats};

/// A point in time as the store keeps it: `TIMESTAMPTZ` in Postgres, integer unix
/// milliseconds in SQLite.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ts(pub DateTime<Utc>);

impl From<Ts> for DateTime<Utc> {
    fn from(t: Ts) -> DateTime<Utc> {
        t.0
    }
}

impl sqlx::Type<Postgres> for Ts {
    fn type_info() -> sqlx::postgres::PgTypeInfo {
        <DateTime<Utc> as sqlx::Type<Postgres>>::type_info()
    }
    fn compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
        <DateTime<Utc> as sqlx::Type<Postgres>>::compatible(ty)
    }
}

impl sqlx::postgres::PgHasArrayType for Ts {
    fn array_type_info() -> sqlx::postgres::PgTypeInfo {
        <DateTime<Utc> as sqlx::postgres::PgHasArrayType>::array_type_info()
    }
}

impl<'q> sqlx::Encode<'q, Postgres> for Ts {
    fn encode_by_ref(
        &self,
        buf: &mut sqlx::postgres::PgArgumentBuffer,
    ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
        <DateTime<Utc> as sqlx::Encode<'q, Postgres>>::encode_by_ref(&self.0, buf)
    }
}

impl<'r> sqlx::Decode<'r, Postgres> for Ts {
    fn decode(v: sqlx::postgres::PgValueRef<'r>) -> Result<Ts, sqlx::error::BoxDynError> {
        Ok(Ts(<DateTime<Utc> as sqlx::Decode<'r, Postgres>>::decode(
            v,
        )?))
    }
}

impl sqlx::Type<Sqlite> for Ts {
    fn type_info() -> sqlx::sqlite::SqliteTypeInfo {
        <i64 as sqlx::Type<Sqlite>>::type_info()
    }
    fn compatible(ty: &sqlx::sqlite::SqliteTypeInfo) -> bool {
        <i64 as sqlx::Type<Sqlite>>::compatible(ty)
    }
}

impl<'q> sqlx::Encode<'q, Sqlite> for Ts {
    fn encode_by_ref(
        &self,
        buf: &mut Vec<sqlx::sqlite::SqliteArgumentValue<'q>>,
    ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
        <i64 as sqlx::Encode<'q, Sqlite>>::encode(self.0.timestamp_millis(), buf)
    }
}

impl<'r> sqlx::Decode<'r, Sqlite> for Ts {
    fn decode(v: sqlx::sqlite::SqliteValueRef<'r>) -> Result<Ts, sqlx::error::BoxDynError> {
        let ms = <i64 as sqlx::Decode<'r, Sqlite>>::decode(v)?;
        Utc.timestamp_millis_opt(ms)
            .single()
            .map(Ts)
            .ok_or_else(|| format!("timestamp {ms} ms out of range").into())
    }
}

/// The tick time of a report: the controller sends unix seconds (a number); a string holding
/// a number or an RFC 3339 time is accepted too. Anything else is the time it was received.
pub fn tick_time(t: &Tick, received_at: DateTime<Utc>) -> DateTime<Utc> {
    let secs = match (t.secs(), t) {
        (Some(v), _) => Some(v),
        (None, Tick::Text(s)) => {
            return DateTime::parse_from_rfc3339(s)
                .map(|d| d.with_timezone(&Utc))
                .unwrap_or(received_at)
        }
        (None, _) => None,
    };
    secs.filter(|s| s.is_finite())
        .and_then(|s| Utc.timestamp_millis_opt((s * 1000.0) as i64).single())
        .unwrap_or(received_at)
}

/// A row's sequence number as stored (a `BIGINT`; the controller's stay below 2^53).
fn seq_of(r: &ReportRow) -> i64 {
    i64::try_from(r.seq).unwrap_or(i64::MAX)
}

/// The minute `t` falls in.
pub fn minute_of(t: DateTime<Utc>) -> DateTime<Utc> {
    t.duration_trunc(Duration::minutes(1)).unwrap_or(t)
}

/// Most override rows recorded per sighting or read per plan (an override and a bucket it acts
/// on; the controller holds at most 1,000 overrides by default).
pub const MAX_OVERRIDE_ROWS: usize = 100_000;

/// How long after rlc last saw an override listed it still counts as in force, when it was
/// removed before its expiry (rlc sees the list at each report poll and each run).
pub const OVERRIDE_SEEN_GRACE_SECS: i64 = 300;

/// A region whose controller rlc could not read ([`Store::unread_regions`]): its reports and
/// overrides since `since` are missing from the shadow figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct UnreadRegion {
    /// The region (`region:` of its controller in rlc.yaml; `default` without one).
    pub region: String,
    /// The first failed read since the last good one.
    pub since: DateTime<Utc>,
    /// Why it could not be read.
    pub error: String,
}

impl UnreadRegion {
    /// The regions as one sentence, for a run's or a page's note.
    pub fn sentence(regions: &[UnreadRegion]) -> String {
        let each: Vec<String> = regions
            .iter()
            .map(|r| {
                format!(
                    "region {}'s controller cannot be read since {} ({})",
                    r.region,
                    r.since.format("%Y-%m-%d %H:%M:%S UTC"),
                    r.error
                )
            })
            .collect();
        format!("shadow figures incomplete: {}", each.join("; "))
    }
}

/// One row of `shadow_minutes`: what one scope key of a bucket reported in one minute.
/// Sums are sums of per-report rates (one report per controller tick), so `offered /
/// reports` is the minute's average offered rate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, sqlx::FromRow)]
pub struct MinuteRow {
    /// Scope key ('' or `global` for a global bucket, else a region or a zone).
    pub scope_key: String,
    /// Start of the minute.
    #[sqlx(try_from = "Ts")]
    pub minute: DateTime<Utc>,
    /// Reports summed (ticks).
    pub reports: i64,
    /// Requests offered (the rows' counts; rates of rows without them, one second each).
    pub offered: f64,
    /// Requests admitted.
    pub admitted: f64,
    /// Requests dropped (enforced).
    pub dropped: f64,
    /// Requests virtually dropped (shadow).
    pub shadow_dropped: f64,
    /// Highest offered rate of one report.
    pub max_offered: f64,
    /// Highest drop ratio of one report.
    pub max_drop_ratio: f64,
    /// The newest tick in the minute.
    #[sqlx(try_from = "Ts")]
    pub last_t: DateTime<Utc>,
    /// Limit of the minute's latest report.
    pub limit_rps: f64,
    /// Mode of the minute's latest report.
    pub mode: String,
}

impl MinuteRow {
    fn avg(&self, sum: f64) -> f64 {
        if self.reports > 0 {
            sum / self.reports as f64
        } else {
            0.0
        }
    }
    /// Average offered rate in the minute (rps).
    pub fn offered_rps(&self) -> f64 {
        self.avg(self.offered)
    }
    /// Average virtual-drop rate (rps).
    pub fn shadow_dropped_rps(&self) -> f64 {
        self.avg(self.shadow_dropped)
    }
    /// Average real drop rate (rps).
    pub fn dropped_rps(&self) -> f64 {
        self.avg(self.dropped)
    }
}

/// One step of a bucket's chart for one scope key, grouped in SQL ([`Store::bucket_steps`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, sqlx::FromRow)]
pub struct StepRow {
    /// Scope key.
    pub scope_key: String,
    /// Index of the step from the window's start.
    pub step: i64,
    /// Highest per-minute average offered rate in the step.
    pub offered_rps: f64,
    /// Highest per-minute average virtual-drop rate.
    pub virtual_drop_rps: f64,
    /// Highest per-minute average drop rate.
    pub drop_rps: f64,
    /// Requests offered in the step (orders the scope keys, busiest first).
    pub offered: f64,
    /// Limit of the step's newest minute.
    pub limit_rps: f64,
}

/// The cells of a `shadow_tier_minutes` row after its key: for each tier, least critical
/// first, the requests offered, dropped and virtually dropped.
pub(super) const TIER_CELLS: [&str; 12] = [
    "sheddable_offered",
    "sheddable_dropped",
    "sheddable_shadow_dropped",
    "sheddable_plus_offered",
    "sheddable_plus_dropped",
    "sheddable_plus_shadow_dropped",
    "critical_offered",
    "critical_dropped",
    "critical_shadow_dropped",
    "critical_plus_offered",
    "critical_plus_dropped",
    "critical_plus_shadow_dropped",
];

/// One step of a bucket's requests of one criticality tier ([`Store::tier_steps`]): every
/// scope key together, the requests counted in the step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TierStepRow {
    /// The tier (`CRITICAL_PLUS`, `CRITICAL`, `SHEDDABLE_PLUS`, `SHEDDABLE`).
    pub tier: schema::Criticality,
    /// Index of the step from the window's start.
    pub step: i64,
    /// Requests offered.
    pub offered: f64,
    /// Requests admitted (virtual drops included).
    pub admitted: f64,
    /// Requests dropped (enforce).
    pub dropped: f64,
    /// Requests that would have been dropped (shadow).
    pub shadow_dropped: f64,
}

/// The steps of `rows` (minute rows, by minute) as [`Store::bucket_steps`] groups them in
/// SQL: the reference it is tested against.
pub fn steps_from_minutes(
    rows: &[MinuteRow],
    window_start: DateTime<Utc>,
    step_secs: i64,
) -> Vec<StepRow> {
    let mut m: BTreeMap<(String, i64), (StepRow, DateTime<Utc>)> = BTreeMap::new();
    for r in rows
        .iter()
        .filter(|r| r.reports > 0 && r.minute >= window_start)
    {
        let step = (r.minute.timestamp() - window_start.timestamp()) / step_secs.max(1);
        let e = m.entry((r.scope_key.clone(), step)).or_insert_with(|| {
            (
                StepRow {
                    scope_key: r.scope_key.clone(),
                    step,
                    offered_rps: f64::MIN,
                    virtual_drop_rps: f64::MIN,
                    drop_rps: f64::MIN,
                    offered: 0.0,
                    limit_rps: r.limit_rps,
                },
                r.minute,
            )
        });
        let s = &mut e.0;
        s.offered_rps = s.offered_rps.max(r.offered_rps());
        s.virtual_drop_rps = s.virtual_drop_rps.max(r.shadow_dropped_rps());
        s.drop_rps = s.drop_rps.max(r.dropped_rps());
        s.offered += r.offered;
        if r.minute >= e.1 {
            e.1 = r.minute;
            s.limit_rps = r.limit_rps;
        }
    }
    m.into_values().map(|(s, _)| s).collect()
}

/// A bucket-wide roll-up over fixed periods (every scope key of the bucket together), upserted
/// with the minute roll-ups in the same transaction: `shadow_blocks` (ten minutes),
/// `shadow_bucket_hours` and `shadow_bucket_days`. Only sums, extrema and counts, so an upsert
/// keeps them exact however reports are batched, and a row holds everything stored for its
/// period up to now, the current period included. The overview sums the coarsest rows that
/// tile its window ([`Store::shadow_summary`]): 31 rows a bucket over 30 days instead of
/// 4,320 blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Period {
    /// The table.
    pub table: &'static str,
    /// Its time column: the period's start.
    pub column: &'static str,
    /// Length in seconds (a divisor of a day; periods start at unix multiples of it).
    pub secs: i64,
}

/// Ten-minute roll-ups per (service, bucket).
pub(super) const BLOCKS: Period = Period {
    table: "shadow_blocks",
    column: "block",
    secs: 600,
};
/// Hourly roll-ups per (service, bucket) (not `shadow_hours`: that one is per scope key and
/// rebuilt by the periodic pass).
pub(super) const BUCKET_HOURS: Period = Period {
    table: "shadow_bucket_hours",
    column: "hour",
    secs: 3600,
};
/// Daily roll-ups per (service, bucket), UTC days.
pub(super) const BUCKET_DAYS: Period = Period {
    table: "shadow_bucket_days",
    column: "day",
    secs: 86_400,
};
/// Every bucket-wide roll-up, finest first.
pub(super) const PERIODS: [Period; 3] = [BLOCKS, BUCKET_HOURS, BUCKET_DAYS];

impl Period {
    /// The period `t` falls in.
    pub fn of(&self, t: DateTime<Utc>) -> DateTime<Utc> {
        t.duration_trunc(Duration::seconds(self.secs)).unwrap_or(t)
    }

    /// The first period boundary at or after `t`.
    pub fn ceil(&self, t: DateTime<Utc>) -> DateTime<Utc> {
        let p = self.of(t);
        if p == t {
            p
        } else {
            p + Duration::seconds(self.secs)
        }
    }

    /// The columns of an insert, in [`BlockAcc`] order.
    fn columns(&self) -> String {
        format!(
            "service, bucket, {}, reports, enforce_reports, offered, admitted, dropped, shadow_dropped, \
             max_offered, max_drop_ratio, first_t, last_t",
            self.column
        )
    }

    /// The upsert of an insert `INSERT INTO {table} AS b`: sums add up, extrema stay extrema.
    fn upsert_set(&self) -> String {
        format!(
            " ON CONFLICT (service, bucket, {}) DO UPDATE SET \
    reports = b.reports + excluded.reports, enforce_reports = b.enforce_reports + excluded.enforce_reports, \
    offered = b.offered + excluded.offered, admitted = b.admitted + excluded.admitted, \
    dropped = b.dropped + excluded.dropped, shadow_dropped = b.shadow_dropped + excluded.shadow_dropped, \
    max_offered = CASE WHEN excluded.max_offered > b.max_offered THEN excluded.max_offered ELSE b.max_offered END, \
    max_drop_ratio = CASE WHEN excluded.max_drop_ratio > b.max_drop_ratio THEN excluded.max_drop_ratio ELSE b.max_drop_ratio END, \
    first_t = CASE WHEN excluded.first_t < b.first_t THEN excluded.first_t ELSE b.first_t END, \
    last_t = CASE WHEN excluded.last_t > b.last_t THEN excluded.last_t ELSE b.last_t END",
            self.column
        )
    }

    /// Postgres: a CTE named `name` that upserts the new reports of CTE `ins` into this roll-up.
    fn pg_upsert_cte(&self, name: &str) -> String {
        format!(
            "{name} AS (INSERT INTO {table} AS b ({cols}) \
             SELECT service, bucket, to_timestamp(floor(extract(epoch FROM t) / {secs}) * {secs}), \
                    COUNT(*), COUNT(*) FILTER (WHERE mode = 'enforce'), SUM(offered), SUM(admitted), \
                    SUM(dropped), SUM(shadow_dropped), MAX(rate), MAX(drop_ratio), MIN(t), MAX(t) \
             FROM ins GROUP BY 1, 2, 3 ORDER BY 1, 2, 3{set})",
            table = self.table,
            cols = self.columns(),
            secs = self.secs,
            set = self.upsert_set(),
        )
    }
}

/// The ten minutes (`shadow_blocks`) `t` falls in.
pub fn block_of(t: DateTime<Utc>) -> DateTime<Utc> {
    BLOCKS.of(t)
}

/// Where an overview window of `span` ending at `now` starts: at the boundary at or before
/// `now - span` of the longest roll-up period that is at most a sixth of the window (a minute,
/// ten minutes, an hour or a UTC day), so the window is at most a sixth longer than asked and
/// is summed from a few rows a bucket (1 h: six blocks; 24 h: 25 hours; 30 days: 31 days).
pub fn window_start(now: DateTime<Utc>, span: Duration) -> DateTime<Utc> {
    let from = now - span;
    match PERIODS
        .iter()
        .rev()
        .find(|p| span >= Duration::seconds(6 * p.secs))
    {
        Some(p) => p.of(from),
        None => minute_of(from),
    }
}

/// Length of a `shadow_hours` roll-up.
pub const HOUR_SECS: i64 = BUCKET_HOURS.secs;

/// The hour (`shadow_hours`) `t` falls in.
pub fn hour_of(t: DateTime<Utc>) -> DateTime<Utc> {
    BUCKET_HOURS.of(t)
}

/// One row of `shadow_hours` as the readiness figures read it ([`CLEAN_HOUR_ROWS`]), or the
/// mark of an hour that was dirty when they were read (`dirty` 1, every figure 0).
#[derive(Debug, Clone, sqlx::FromRow)]
struct HourRow {
    hour: Ts,
    offered: f64,
    dropped: f64,
    shadow_dropped: f64,
    rates: i64,
    rate_sum: f64,
    rate_min: f64,
    rate_max: f64,
    bucket_minutes: i64,
    peak_share: f64,
    peak_minute: Option<Ts>,
    dirty: i64,
}

/// The `shadow_hours` rows of a bucket (`$1`, `$2`) in `[$3, $4)` whose hour is clean, and
/// the marks of the dirty hours of that range, in one statement (one snapshot): a reader
/// that found those hours clean before ([`Store::clean_hours`]) takes the minutes of any
/// hour re-marked since by a late report instead of its stale row.
const CLEAN_HOUR_ROWS: &str = "SELECT hour, offered, dropped, shadow_dropped, rates, rate_sum, rate_min, rate_max, \
        bucket_minutes, peak_share, peak_minute, CAST(0 AS BIGINT) AS dirty \
 FROM shadow_hours h WHERE service = $1 AND bucket = $2 AND hour >= $3 AND hour < $4 \
   AND NOT EXISTS (SELECT 1 FROM shadow_dirty_hours d WHERE d.hour = h.hour) \
 UNION ALL \
 SELECT hour, CAST(0 AS DOUBLE PRECISION), CAST(0 AS DOUBLE PRECISION), CAST(0 AS DOUBLE PRECISION), \
        CAST(0 AS BIGINT), CAST(0 AS DOUBLE PRECISION), CAST(0 AS DOUBLE PRECISION), \
        CAST(0 AS DOUBLE PRECISION), CAST(0 AS BIGINT), CAST(0 AS DOUBLE PRECISION), NULL, \
        CAST(1 AS BIGINT) \
 FROM shadow_dirty_hours WHERE hour >= $3 AND hour < $4";

/// Test hook: runs right after a reader has read the dirty hours ([`Store::clean_hours`]),
/// in the reader's task only; a test stores a late report there.
#[cfg(test)]
pub(crate) mod hook {
    pub(crate) type Hook = std::sync::Arc<
        dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send + Sync,
    >;
    tokio::task_local! {
        pub(crate) static AFTER_CLEAN_HOURS: Hook;
    }
    pub(super) async fn after_clean_hours() {
        if let Ok(h) = AFTER_CLEAN_HOURS.try_with(|h| h.clone()) {
            h().await
        }
    }
}

/// Reports deleted by [`Store::apply_retention`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Retained {
    /// Full-resolution reports deleted.
    pub raw_deleted: u64,
    /// Minute roll-ups deleted.
    pub minutes_deleted: u64,
    /// Ten-minute roll-ups deleted (those whose every minute is before the roll-up retention).
    pub blocks_deleted: u64,
    /// Hourly roll-ups per scope key deleted (those whose every minute is before the roll-up
    /// retention).
    pub hours_deleted: u64,
    /// Bucket-wide hourly roll-ups deleted (the same rule).
    pub bucket_hours_deleted: u64,
    /// Bucket-wide daily roll-ups deleted (the same rule).
    pub bucket_days_deleted: u64,
}

impl Store {
    /// Whether independent queries may run at once: on Postgres (a pool of connections), not
    /// on SQLite (one connection: concurrent queries would only queue, and the queued ones
    /// could time out waiting for each other).
    pub fn concurrent(&self) -> bool {
        matches!(self, Store::Postgres(_))
    }

    /// The hours of `[start, end)` whose `shadow_hours` rows a reader may use: whole hours
    /// inside the window, from the first one up to the first dirty one (or the window's
    /// last whole hour). Readers take the minutes before and after from `shadow_minutes`.
    /// `(start, start)` when there is none. A late report may mark one of these hours dirty
    /// again before the reader reads its rows: the readers therefore read the rows together
    /// with the marks ([`CLEAN_HOUR_ROWS`], and the hour branch of [`Store::bucket_steps`]).
    async fn clean_hours(
        &self,
        start: DateTime<Utc>,
        end: DateTime<Utc>,
    ) -> Result<(DateTime<Utc>, DateTime<Utc>), StoreError> {
        let (from, to) = (BUCKET_HOURS.ceil(start), hour_of(end));
        if to <= from {
            return Ok((start, start));
        }
        let (dirty,): (Option<Ts>,) = on_pool!(self, pool => sqlx::query_as(
            "SELECT MIN(hour) FROM shadow_dirty_hours WHERE hour >= $1 AND hour < $2",
        )
        .bind(Ts(from))
        .bind(Ts(to))
        .fetch_one(pool)
        .await?);
        #[cfg(test)]
        hook::after_clean_hours().await;
        let to = dirty.map_or(to, |d| d.0);
        Ok(if to <= from {
            (start, start)
        } else {
            (from, to)
        })
    }

    /// Stored full-resolution reports, optionally of one service, by sequence number (at
    /// most `limit`).
    pub async fn reports(
        &self,
        service: Option<&str>,
        limit: i64,
    ) -> Result<Vec<StoredReport>, StoreError> {
        on_pool!(self, pool => Ok(sqlx::query_as::<_, StoredReport>(
            "SELECT seq, t, service, bucket, caller, procedure, mode, scope_key, offered, admitted, dropped, shadow_dropped, limit_rps, drop_ratio \
             FROM shadow_reports WHERE ($1 IS NULL OR service = $1) ORDER BY seq, service, bucket, scope_key LIMIT $2",
        )
        .bind(service)
        .bind(limit)
        .fetch_all(pool)
        .await?))
    }

    /// The minutes since `since` in which an enforced bucket refused requests, with the
    /// requests it refused, by `(service, bucket)`. A scope key's refused requests in a minute
    /// are its average dropped rate over the time its reports span (from the first to the last,
    /// plus one report's share: a 4-second overload counts 4 seconds, not the minute). At most
    /// `max_rows` rows (a minute of one scope key) are read, oldest first; the second value
    /// says whether some were left.
    pub async fn throttled_minutes(
        &self,
        since: DateTime<Utc>,
        max_rows: usize,
    ) -> Result<(rlc_plan::censor::ThrottledMinutes, bool), StoreError> {
        let limit = i64::try_from(max_rows.saturating_add(1)).unwrap_or(i64::MAX);
        let rows: Vec<(String, String, Ts, i64, f64, Ts, Ts)> = on_pool!(self, pool => sqlx::query_as(
            "SELECT service, bucket, minute, reports, dropped, first_t, last_t FROM shadow_minutes \
             WHERE minute >= $1 AND mode = 'enforce' AND dropped > 0 AND reports > 0 \
             ORDER BY minute, service, bucket LIMIT $2",
        )
        .bind(Ts(since))
        .bind(limit)
        .fetch_all(pool)
        .await?);
        let truncated = rows.len() > max_rows;
        let mut out = rlc_plan::censor::ThrottledMinutes::new();
        for (service, bucket, minute, reports, dropped, first, last) in
            rows.into_iter().take(max_rows)
        {
            let n = reports.max(1) as f64;
            let span = (last.0 - first.0).num_milliseconds().max(0) as f64 / 1000.0;
            let covered = if reports > 1 {
                span * n / (n - 1.0)
            } else {
                1.0
            };
            let refused = dropped / n * covered.clamp(1.0, 60.0);
            let t = out.entry((service, bucket)).or_default();
            let m = minute.0.timestamp();
            if t.minutes.last() != Some(&m) {
                t.minutes.push(m);
            }
            if refused.is_finite() && refused > 0.0 {
                t.refused += refused;
            }
        }
        Ok((out, truncated))
    }

    /// The busiest minute of each bucket's critical demand (CRITICAL_PLUS and CRITICAL
    /// requests offered, every scope key together) since `since`, from `shadow_tier_minutes`:
    /// its mean rate (the minute's requests ÷ 60) and the minute, by `(service, bucket)`; one
    /// row per bucket (the earliest minute on a tie). Buckets whose clients count no tiers
    /// have none.
    pub async fn critical_peaks(
        &self,
        since: DateTime<Utc>,
    ) -> Result<BTreeMap<(String, String), (f64, DateTime<Utc>)>, StoreError> {
        let rows: Vec<(String, String, Ts, f64)> = on_pool!(self, pool => sqlx::query_as(
            // Each bucket's peak (a hash aggregate), then its earliest minute at the peak:
            // no sort of the window's rows (4.3 million rows, 1,000 buckets × 3 days, on
            // Postgres: 2.6 s, where a window function took 4.7 s).
            "WITH p AS (SELECT service, bucket, MAX(critical_offered + critical_plus_offered) AS o \
                        FROM shadow_tier_minutes WHERE minute >= $1 GROUP BY service, bucket) \
             SELECT t.service, t.bucket, MIN(t.minute), p.o FROM shadow_tier_minutes t \
             JOIN p ON p.service = t.service AND p.bucket = t.bucket \
                   AND t.critical_offered + t.critical_plus_offered = p.o \
             WHERE t.minute >= $1 AND p.o > 0 GROUP BY t.service, t.bucket, p.o",
        )
        .bind(Ts(since))
        .fetch_all(pool)
        .await?);
        Ok(rows
            .into_iter()
            .map(|(service, bucket, minute, o)| ((service, bucket), (o / 60.0, minute.0)))
            .collect())
    }

    /// Records whether `region`'s controller could be read at `at` (`error`: why not): a
    /// region stays unread from its first failed read until a good one, which deletes its row.
    /// With `configured` (the controllers of rlc.yaml), the rows of other regions go too.
    pub async fn record_region_read(
        &self,
        region: &str,
        at: DateTime<Utc>,
        error: Option<&str>,
        configured: Option<&[String]>,
    ) -> Result<(), StoreError> {
        let error = error.map(|e| e.chars().take(500).collect::<String>());
        on_pool!(self, pool => {
            let mut tx = pool.begin().await?;
            if let Some(regions) = configured {
                let have: Vec<(String,)> = sqlx::query_as("SELECT region FROM controller_regions")
                    .fetch_all(&mut *tx)
                    .await?;
                for (gone,) in have.iter().filter(|(r,)| !regions.contains(r)) {
                    sqlx::query("DELETE FROM controller_regions WHERE region = $1")
                        .bind(gone)
                        .execute(&mut *tx)
                        .await?;
                }
            }
            match &error {
                None => sqlx::query("DELETE FROM controller_regions WHERE region = $1")
                    .bind(region)
                    .execute(&mut *tx)
                    .await?,
                Some(e) => sqlx::query(
                    "INSERT INTO controller_regions AS c (region, unread_since, error) \
                     VALUES ($1, $2, $3) ON CONFLICT (region) DO UPDATE SET \
                     unread_since = c.unread_since, error = excluded.error",
                )
                .bind(region)
                .bind(Ts(at))
                .bind(e)
                .execute(&mut *tx)
                .await?,
            };
            tx.commit().await?;
            Ok(())
        })
    }

    /// The regions whose controller could not be read at the last poll, by region.
    pub async fn unread_regions(&self) -> Result<Vec<UnreadRegion>, StoreError> {
        let rows: Vec<(String, Ts, String)> = on_pool!(self, pool => sqlx::query_as(
            "SELECT region, unread_since, error FROM controller_regions ORDER BY region",
        )
        .fetch_all(pool)
        .await?);
        Ok(rows
            .into_iter()
            .map(|(region, since, error)| UnreadRegion {
                region,
                since: since.0,
                error,
            })
            .collect())
    }

    /// Records the overrides `list` that `region`'s controller had in force at `seen`: one
    /// row per override and bucket of the config it acts on (at most `MAX_OVERRIDE_ROWS`), its
    /// last sighting moved to `seen`; and the overrides of that region seen before but no longer
    /// listed, not expired yet, are marked gone at `seen` (removed early).
    pub async fn record_overrides(
        &self,
        region: &str,
        list: &crate::push::OverrideList,
        seen: DateTime<Utc>,
    ) -> Result<u64, StoreError> {
        let at = |t: i64| Ts(DateTime::from_timestamp(t, 0).unwrap_or_default());
        type Row<'a> = (&'a str, Ts, &'a str, &'a str, &'a str, Ts, &'a str, String);
        let rows: Vec<Row> = list
            .overrides
            .iter()
            .flat_map(|o| {
                let action = o.action();
                o.affects.iter().filter(|a| !a.created).map(move |a| {
                    (
                        o.id.as_str(),
                        at(o.created_at),
                        a.service.as_str(),
                        a.bucket.as_str(),
                        o.reason.as_str(),
                        at(o.expires_at),
                        o.who.as_str(),
                        action.clone(),
                    )
                })
            })
            .take(MAX_OVERRIDE_ROWS)
            .collect();
        let mut n = 0;
        for chunk in rows.chunks(1_000) {
            n += on_pool!(self, pool => {
                let mut q = sqlx::QueryBuilder::new(
                    "INSERT INTO override_windows AS w (override_id, created_at, service, bucket, reason, expires_at, last_seen, who, action, region, gone_at) ",
                );
                q.push_values(chunk, |mut b, r| {
                    b.push_bind(r.0)
                        .push_bind(r.1)
                        .push_bind(r.2)
                        .push_bind(r.3)
                        .push_bind(r.4)
                        .push_bind(r.5)
                        .push_bind(Ts(seen))
                        .push_bind(r.6)
                        .push_bind(r.7.as_str())
                        .push_bind(region)
                        .push_bind(None::<Ts>);
                });
                q.push(
                    " ON CONFLICT (override_id, created_at, service, bucket) DO UPDATE SET \
                     reason = excluded.reason, expires_at = excluded.expires_at, who = excluded.who, \
                     action = excluded.action, region = excluded.region, gone_at = NULL, \
                     last_seen = CASE WHEN excluded.last_seen > w.last_seen THEN excluded.last_seen ELSE w.last_seen END",
                );
                q.build().execute(pool).await?.rows_affected()
            });
        }
        // Listed before, not now, not expired: removed.
        on_pool!(self, pool => sqlx::query(
            "UPDATE override_windows SET gone_at = $1 \
             WHERE region = $2 AND gone_at IS NULL AND last_seen < $1 AND expires_at > $1",
        )
        .bind(Ts(seen))
        .bind(region)
        .execute(pool)
        .await?
        .rows_affected());
        Ok(n)
    }

    /// The overrides that acted on buckets since `since`, by `(service, bucket)`: each from its
    /// start to its expiry or, removed early, `OVERRIDE_SEEN_GRACE_SECS` after rlc last saw
    /// it. At most `MAX_OVERRIDE_ROWS` rows.
    pub async fn override_windows(
        &self,
        since: DateTime<Utc>,
    ) -> Result<BTreeMap<(String, String), Vec<rlc_plan::censor::OverrideWindow>>, StoreError> {
        type Row = (
            String,
            Ts,
            String,
            String,
            String,
            Ts,
            Ts,
            String,
            String,
            String,
            Option<Ts>,
        );
        let rows: Vec<Row> = on_pool!(self, pool => sqlx::query_as(
            "SELECT override_id, created_at, service, bucket, reason, expires_at, last_seen, who, action, region, gone_at \
             FROM override_windows WHERE expires_at >= $1 ORDER BY created_at LIMIT $2",
        )
        .bind(Ts(since))
        .bind(MAX_OVERRIDE_ROWS as i64)
        .fetch_all(pool)
        .await?);
        let mut out: BTreeMap<(String, String), Vec<rlc_plan::censor::OverrideWindow>> =
            BTreeMap::new();
        for (id, created, service, bucket, reason, expires, seen, who, action, region, gone) in rows
        {
            // Removed early: until its controller stopped listing it; not seen lately (rlc
            // stopped polling, or a row from before `gone_at`): shortly after the last sighting.
            let to = match gone {
                Some(g) => expires.0.min(g.0),
                None => expires
                    .0
                    .min(seen.0 + Duration::seconds(OVERRIDE_SEEN_GRACE_SECS)),
            };
            if to <= since {
                continue;
            }
            out.entry((service, bucket))
                .or_default()
                .push(rlc_plan::censor::OverrideWindow {
                    id,
                    from: created.0,
                    to,
                    reason,
                    who,
                    action,
                    expires_at: expires.0,
                    region,
                });
        }
        Ok(out)
    }

    /// The minute roll-ups of one bucket with `from <= minute < to`, by minute then scope key.
    pub async fn bucket_minutes(
        &self,
        service: &str,
        bucket: &str,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Result<Vec<MinuteRow>, StoreError> {
        on_pool!(self, pool => Ok(sqlx::query_as::<_, MinuteRow>(
            "SELECT scope_key, minute, reports, offered, admitted, dropped, shadow_dropped, max_offered, \
                    max_drop_ratio, last_t, limit_rps, mode \
             FROM shadow_minutes WHERE service = $1 AND bucket = $2 AND minute >= $3 AND minute < $4 \
             ORDER BY minute, scope_key",
        )
        .bind(service)
        .bind(bucket)
        .bind(Ts(from))
        .bind(Ts(to))
        .fetch_all(pool)
        .await?))
    }

    /// What the store knows of a bucket beyond a window: its newest tick and the start of its
    /// current shadow period (the first shadow minute after its newest enforce minute, within
    /// the roll-up retention). Index range lookups on the primary key (service, bucket, minute).
    pub async fn bucket_span(
        &self,
        service: &str,
        bucket: &str,
    ) -> Result<(Option<DateTime<Utc>>, Option<DateTime<Utc>>), StoreError> {
        on_pool!(self, pool => {
            let (last,): (Option<Ts>,) = sqlx::query_as(
                "SELECT MAX(last_t) FROM shadow_minutes WHERE service = $1 AND bucket = $2 AND minute = \
                 (SELECT MAX(minute) FROM shadow_minutes WHERE service = $1 AND bucket = $2)",
            )
            .bind(service)
            .bind(bucket)
            .fetch_one(pool)
            .await?;
            // The newest ten minutes with an enforce report bound the search for the newest
            // enforced minute from above (a minute whose latest report is `enforce` has one in
            // its block), so a bucket that stayed in shadow is not scanned minute by minute.
            let block: Option<(Ts,)> = sqlx::query_as(
                "SELECT block FROM shadow_blocks WHERE service = $1 AND bucket = $2 AND enforce_reports > 0 \
                 ORDER BY block DESC LIMIT 1",
            )
            .bind(service)
            .bind(bucket)
            .fetch_optional(pool)
            .await?;
            let enforced: Option<(Ts,)> = match block {
                None => None,
                Some((b,)) => sqlx::query_as(
                    "SELECT minute FROM shadow_minutes WHERE service = $1 AND bucket = $2 AND mode = 'enforce' \
                     AND minute < $3 ORDER BY minute DESC LIMIT 1",
                )
                .bind(service)
                .bind(bucket)
                .bind(Ts(b.0 + Duration::seconds(BLOCKS.secs)))
                .fetch_optional(pool)
                .await?,
            };
            let since: Option<(Ts,)> = sqlx::query_as(
                "SELECT first_t FROM shadow_minutes \
                 WHERE service = $1 AND bucket = $2 AND mode = 'shadow' AND ($3 IS NULL OR minute > $3) \
                 ORDER BY minute, first_t LIMIT 1",
            )
            .bind(service)
            .bind(bucket)
            .bind(enforced.map(|e| e.0))
            .fetch_optional(pool)
            .await?;
            Ok((last.map(Into::into), since.map(|s| s.0.into())))
        })
    }

    /// The readiness figures of one bucket over `[window_start, window_end)`, from the
    /// roll-ups; `None` when the store has no report of the bucket at all. The promotion
    /// logic and the dashboard both call this.
    ///
    /// The same figures as [`stats_from_minutes`] over [`Store::bucket_minutes`] (up to the
    /// order floating-point sums are added in): the clean whole hours of the window
    /// come from `shadow_hours`, the minutes before and after from
    /// `shadow_minutes`. The suggested limit stays exact: a lower bound is solved from each
    /// hour's highest per-minute rate (every hour has a minute at its highest rate, so the
    /// true loss at any limit is at least the bound's), then only the minutes of hours
    /// whose highest rate reaches it are fetched, and only those at or above it (an hour
    /// whose rates are all equal counts as that rate times their number without a fetch).
    pub async fn shadow_stats(
        &self,
        service: &str,
        bucket: &str,
        window_start: DateTime<Utc>,
        window_end: DateTime<Utc>,
    ) -> Result<Option<ShadowStats>, StoreError> {
        let (last, since) = self.bucket_span(service, bucket).await?;
        if last.is_none() {
            return Ok(None);
        }
        let (hf, ht) = self.clean_hours(window_start, window_end).await?;
        let (start, end) = (Ts(window_start), Ts(window_end));
        let (minutes, hours, latest): (Vec<MinuteRow>, Vec<HourRow>, Option<(String, f64)>) = on_pool!(self, pool => {
            let minutes = sqlx::query_as::<_, MinuteRow>(
                "SELECT scope_key, minute, reports, offered, admitted, dropped, shadow_dropped, max_offered, \
                        max_drop_ratio, last_t, limit_rps, mode \
                 FROM shadow_minutes WHERE service = $1 AND bucket = $2 AND minute >= $3 AND minute < $4 \
                 UNION ALL \
                 SELECT scope_key, minute, reports, offered, admitted, dropped, shadow_dropped, max_offered, \
                        max_drop_ratio, last_t, limit_rps, mode \
                 FROM shadow_minutes WHERE service = $1 AND bucket = $2 AND minute >= $5 AND minute < $6",
            )
            .bind(service)
            .bind(bucket)
            .bind(start)
            .bind(Ts(hf))
            .bind(Ts(ht))
            .bind(end)
            .fetch_all(pool);
            let hours = sqlx::query_as::<_, HourRow>(CLEAN_HOUR_ROWS)
            .bind(service)
            .bind(bucket)
            .bind(Ts(hf))
            .bind(Ts(ht))
            .fetch_all(pool);
            let latest = sqlx::query_as::<_, (String, f64)>(
                "SELECT mode, limit_rps FROM shadow_minutes \
                 WHERE service = $1 AND bucket = $2 AND minute >= $3 AND minute < $4 \
                 ORDER BY minute DESC, last_t DESC, scope_key DESC LIMIT 1",
            )
            .bind(service)
            .bind(bucket)
            .bind(start)
            .bind(end)
            .fetch_optional(pool);
            if self.concurrent() {
                tokio::try_join!(minutes, hours, latest)?
            } else {
                (minutes.await?, hours.await?, latest.await?)
            }
        });
        // Hours marked dirty again since `clean_hours` (a late report): their minutes.
        let (hours, dirty): (Vec<HourRow>, Vec<HourRow>) =
            hours.into_iter().partition(|h| h.dirty == 0);
        let mut minutes = minutes;
        let dirty: BTreeSet<DateTime<Utc>> = dirty.iter().map(|h| h.hour.0).collect();
        if let (Some(first), Some(last)) = (dirty.first(), dirty.last()) {
            let late = self
                .bucket_minutes(
                    service,
                    bucket,
                    *first,
                    *last + Duration::seconds(HOUR_SECS),
                )
                .await?;
            minutes.extend(
                late.into_iter()
                    .filter(|m| dirty.contains(&hour_of(m.minute))),
            );
        }
        // The minutes outside the clean hours, as the reference computes them.
        let mut stats = stats_from_minutes(
            service,
            bucket,
            window_start,
            window_end,
            &minutes,
            last,
            since,
        );
        let mut covered = minutes
            .iter()
            .map(|r| r.minute)
            .collect::<BTreeSet<_>>()
            .len() as i64;
        let mut seen = BTreeSet::new();
        for h in &hours {
            stats.offered += h.offered;
            stats.virtual_dropped += h.shadow_dropped;
            stats.dropped += h.dropped;
            // Bucket-wide figures are repeated in every scope key's row of the hour.
            if seen.insert(h.hour) {
                covered += h.bucket_minutes;
                if let Some(at) = h.peak_minute {
                    let better = h.peak_share > stats.peak_drop_share
                        || (h.peak_share == stats.peak_drop_share
                            && stats.peak_drop_at.is_some_and(|p| at.0 < p));
                    if h.peak_share > 0.0 && better {
                        stats.peak_drop_share = h.peak_share;
                        stats.peak_drop_at = Some(at.0);
                    }
                }
            }
        }
        let window_minutes = ((window_end - window_start).num_seconds() as f64 / 60.0)
            .ceil()
            .max(1.0);
        stats.coverage = (covered as f64 / window_minutes).min(1.0);
        let mode = latest
            .as_ref()
            .map_or("shadow".to_string(), |l| l.0.clone());
        stats.shadow_since = if mode == "shadow" { since } else { None };
        stats.mode = mode;
        stats.limit_rps = latest.map_or(0.0, |l| l.1);
        if !hours.is_empty() {
            stats.suggested_limit_rps = self
                .suggested_limit(service, bucket, &minutes, &hours)
                .await?;
        }
        Ok(Some(stats))
    }

    /// The exact suggested limit over the per-minute rates of `minutes` and of the minutes
    /// rolled up in `hours` (see [`Store::shadow_stats`]).
    async fn suggested_limit(
        &self,
        service: &str,
        bucket: &str,
        minutes: &[MinuteRow],
        hours: &[HourRow],
    ) -> Result<Option<f64>, StoreError> {
        let mut rates: Vec<f64> = minutes
            .iter()
            .map(MinuteRow::offered_rps)
            .filter(|v| v.is_finite() && *v > 0.0)
            .collect();
        rates.sort_by(|a, b| b.total_cmp(a));
        let total = rates.iter().sum::<f64>() + hours.iter().map(|h| h.rate_sum).sum::<f64>();
        let budget = total * readiness::SUGGESTED_LIMIT_DROP_SHARE;
        let mut weighted: Vec<(f64, f64)> = rates.iter().map(|r| (*r, 1.0)).collect();
        let bound: Vec<(f64, f64)> = weighted
            .iter()
            .copied()
            .chain(
                hours
                    .iter()
                    .filter(|h| h.rates > 0)
                    .map(|h| (h.rate_max, 1.0)),
            )
            .collect();
        let Some(low) = readiness::limit_for_budget(&bound, budget) else {
            return Ok(None);
        };
        let mut fetch = BTreeSet::new();
        for h in hours.iter().filter(|h| h.rates > 0 && h.rate_max >= low) {
            if h.rate_min == h.rate_max {
                weighted.push((h.rate_max, h.rates as f64));
            } else {
                fetch.insert(h.hour.0);
            }
        }
        if let (Some(first), Some(last)) = (fetch.first(), fetch.last()) {
            let above: Vec<(Ts, f64)> = on_pool!(self, pool => sqlx::query_as(
                "SELECT minute, offered / reports FROM shadow_minutes \
                 WHERE service = $1 AND bucket = $2 AND minute >= $3 AND minute < $4 \
                   AND reports > 0 AND offered > 0 AND offered / reports >= $5",
            )
            .bind(service)
            .bind(bucket)
            .bind(Ts(*first))
            .bind(Ts(*last + Duration::seconds(HOUR_SECS)))
            .bind(low)
            .fetch_all(pool)
            .await?);
            weighted.extend(
                above
                    .into_iter()
                    .filter(|(m, _)| fetch.contains(&hour_of(m.0)))
                    .map(|(_, r)| (r, 1.0)),
            );
        }
        // Rates below the bound lose nothing at any limit at or above it.
        Ok(readiness::limit_for_budget(&weighted, budget).map(|l| l.max(low)))
    }

    /// The chart of one bucket over `[window_start, window_end)` in steps of `step_secs`,
    /// grouped in SQL: per scope key and step, the highest per-minute average offered,
    /// virtual-drop and drop rates, the limit of the step's newest minute and the step's
    /// summed offered rates. Steps without a minute row are absent (gaps, not zeros). By
    /// scope key, then step. When the steps are whole hours on hour boundaries, the clean
    /// hours of the window come from `shadow_hours` (each lies in one step) and only the
    /// minutes before and after them from `shadow_minutes`, and the minutes of any of those
    /// hours marked dirty again by a late report meanwhile (in the same statement, so one
    /// snapshot decides between an hour's row and its minutes).
    pub async fn bucket_steps(
        &self,
        service: &str,
        bucket: &str,
        window_start: DateTime<Utc>,
        window_end: DateTime<Utc>,
        step_secs: i64,
    ) -> Result<Vec<StepRow>, StoreError> {
        let step_secs = step_secs.max(1);
        let (hf, ht) = if step_secs % HOUR_SECS == 0 && hour_of(window_start) == window_start {
            self.clean_hours(window_start, window_end).await?
        } else {
            (window_start, window_start)
        };
        let (em, el) = (self.epoch_sql("minute"), self.epoch_sql("last_minute"));
        // The minutes of an hour marked dirty: `d.hour` is the hour of `minute`. The dirty
        // hours (few) drive the join, so only their minutes are read, not every minute of the
        // clean span (`CROSS JOIN` keeps that order in SQLite; on Postgres the 30-day bucket
        // page of `bench_shadow_store` went from 203 to 8 ms, docs/rlc-dashboard.md).
        let in_dirty_hour = match self {
            Store::Postgres(_) => "d.hour <= minute AND minute < d.hour + INTERVAL '1 hour'",
            Store::Sqlite(..) => "d.hour <= minute AND minute < d.hour + 3600000",
        };
        let minute_sel = format!(
            "scope_key, {em} AS e, offered / reports AS o, shadow_dropped / reports AS v, \
             dropped / reports AS d, offered, limit_rps"
        );
        let of_bucket = "service = $1 AND bucket = $2 AND reports > 0";
        let minute_cols = format!("{minute_sel} FROM shadow_minutes WHERE {of_bucket}");
        let sql = format!(
            // Per step, the maxima, the sum and the limit of the newest row (a minute, or an
            // hour's newest minute).
            "WITH u AS ( \
                   SELECT {minute_cols} AND minute >= $3 AND minute < $7 \
                   UNION ALL SELECT {minute_cols} AND minute >= $8 AND minute < $4 \
                   UNION ALL SELECT scope_key, {el} AS e, rate_max AS o, max_vd_rps AS v, max_drop_rps AS d, \
                          offered, limit_rps FROM shadow_hours h \
                   WHERE service = $1 AND bucket = $2 AND hour >= $7 AND hour < $8 AND reports > 0 \
                     AND NOT EXISTS (SELECT 1 FROM shadow_dirty_hours d WHERE d.hour = h.hour) \
                   UNION ALL SELECT {minute_sel} FROM shadow_dirty_hours d CROSS JOIN shadow_minutes \
                   WHERE d.hour >= $7 AND d.hour < $8 AND {in_dirty_hour} AND {of_bucket}), \
             s AS (SELECT scope_key, (e - $5) / $6 AS step, o, v, d, offered, \
                          FIRST_VALUE(limit_rps) OVER (PARTITION BY scope_key, (e - $5) / $6 ORDER BY e DESC) AS lim \
                   FROM u) \
             SELECT scope_key, step, MAX(o) AS offered_rps, MAX(v) AS virtual_drop_rps, MAX(d) AS drop_rps, \
                    SUM(offered) AS offered, MAX(lim) AS limit_rps \
             FROM s GROUP BY scope_key, step ORDER BY scope_key, step"
        );
        on_pool!(self, pool => Ok(sqlx::query_as::<_, StepRow>(&sql)
            .bind(service)
            .bind(bucket)
            .bind(Ts(window_start))
            .bind(Ts(window_end))
            .bind(window_start.timestamp())
            .bind(step_secs)
            .bind(Ts(hf))
            .bind(Ts(ht))
            .fetch_all(pool)
            .await?))
    }

    /// The SQL of time column `col` as whole unix seconds, on this backend.
    fn epoch_sql(&self, col: &str) -> String {
        match self {
            Store::Postgres(_) => format!("CAST(EXTRACT(EPOCH FROM {col}) AS BIGINT)"),
            Store::Sqlite(..) => format!("({col} / 1000)"),
        }
    }

    /// The requests of one bucket per step of `step_secs` from `window_start` and per
    /// criticality tier, over `[window_start, window_end)`, every scope key together (from
    /// `shadow_tier_minutes`: the reports' `counts.tiers`), by tier (least critical first)
    /// then step. Empty when the bucket's clients count no tiers.
    pub async fn tier_steps(
        &self,
        service: &str,
        bucket: &str,
        window_start: DateTime<Utc>,
        window_end: DateTime<Utc>,
        step_secs: i64,
    ) -> Result<Vec<TierStepRow>, StoreError> {
        let e = self.epoch_sql("minute");
        let sums: Vec<String> = TIER_CELLS
            .iter()
            .map(|c| format!("CAST(SUM({c}) AS DOUBLE PRECISION)"))
            .collect();
        let sql = format!(
            "SELECT ({e} - $5) / $6 AS step, {} FROM shadow_tier_minutes \
             WHERE service = $1 AND bucket = $2 AND minute >= $3 AND minute < $4 \
             GROUP BY ({e} - $5) / $6",
            sums.join(", ")
        );
        let steps: Vec<(i64, Vec<f64>)> = on_pool!(self, pool => {
            use sqlx::Row;
            let rows = sqlx::query(&sql)
                .bind(service)
                .bind(bucket)
                .bind(Ts(window_start))
                .bind(Ts(window_end))
                .bind(window_start.timestamp())
                .bind(step_secs.max(1))
                .fetch_all(pool)
                .await?;
            let mut out = Vec::with_capacity(rows.len());
            for r in rows {
                let step: i64 = r.try_get(0)?;
                let cells = (1..=TIER_CELLS.len())
                    .map(|i| r.try_get::<f64, _>(i))
                    .collect::<Result<Vec<f64>, _>>()?;
                out.push((step, cells));
            }
            out
        });
        // One row per tier and step with requests, by tier name then step.
        let mut out: Vec<TierStepRow> = steps
            .iter()
            .flat_map(|(step, cells)| {
                schema::Criticality::ALL
                    .iter()
                    .zip(cells.chunks(3))
                    .filter(|(_, c)| c.iter().any(|&x| x > 0.0))
                    .map(|(tier, c)| TierStepRow {
                        tier: *tier,
                        step: *step,
                        offered: c[0],
                        admitted: (c[0] - c[1]).max(0.0),
                        dropped: c[1],
                        shadow_dropped: c[2],
                    })
            })
            .collect();
        // Least critical first, as everywhere else.
        out.sort_by_key(|r| (r.tier, r.step));
        Ok(out)
    }

    /// The minute rows of one bucket over `[window_start, window_end)` and the readiness
    /// figures computed from them in Rust ([`stats_from_minutes`]; `None` when the store has
    /// no report of the bucket at all): the reference the SQL-side figures
    /// ([`Store::shadow_stats`], [`Store::bucket_steps`]) are tested against.
    pub async fn bucket_window(
        &self,
        service: &str,
        bucket: &str,
        window_start: DateTime<Utc>,
        window_end: DateTime<Utc>,
    ) -> Result<(Vec<MinuteRow>, Option<ShadowStats>), StoreError> {
        let (last, since) = self.bucket_span(service, bucket).await?;
        if last.is_none() {
            // No report of the bucket at all: no minute either.
            return Ok((Vec::new(), None));
        }
        let rows = self
            .bucket_minutes(service, bucket, window_start, window_end)
            .await?;
        let stats = stats_from_minutes(
            service,
            bucket,
            window_start,
            window_end,
            &rows,
            last,
            since,
        );
        Ok((rows, Some(stats)))
    }
}

/// The figures of [`ShadowStats`] from a bucket's minute roll-ups in the window (`rows`, by
/// minute), its newest report and the start of its current shadow period:
///
/// - coverage: minutes with a report ÷ minutes of the window;
/// - offered, virtual and real drops: sums of per-report rates (requests with 1 s ticks);
/// - peak drop share: the largest per-minute virtual drops ÷ offered (all scope keys);
/// - suggested limit: [`readiness::suggested_limit`] over the per-minute average offered
///   rates of every scope key (a limit applies per scope key), at
///   [`readiness::SUGGESTED_LIMIT_DROP_SHARE`];
/// - mode and limit: of the newest roll-up in the window (else `shadow`, 0).
pub fn stats_from_minutes(
    service: &str,
    bucket: &str,
    window_start: DateTime<Utc>,
    window_end: DateTime<Utc>,
    rows: &[MinuteRow],
    last_report: Option<DateTime<Utc>>,
    shadow_since: Option<DateTime<Utc>>,
) -> ShadowStats {
    let window_minutes = ((window_end - window_start).num_seconds() as f64 / 60.0)
        .ceil()
        .max(1.0);
    let mut per_minute: BTreeMap<DateTime<Utc>, (f64, f64)> = BTreeMap::new();
    let (mut offered, mut vd, mut dropped) = (0.0, 0.0, 0.0);
    let mut rates = Vec::with_capacity(rows.len());
    for r in rows {
        offered += r.offered;
        vd += r.shadow_dropped;
        dropped += r.dropped;
        rates.push(r.offered_rps());
        let m = per_minute.entry(r.minute).or_default();
        m.0 += r.offered;
        m.1 += r.shadow_dropped;
    }
    let mut peak = (0.0, None);
    for (minute, (o, v)) in &per_minute {
        if *o > 0.0 && v / o > peak.0 {
            peak = (v / o, Some(*minute));
        }
    }
    let latest = rows.iter().max_by_key(|r| (r.minute, r.last_t));
    let mode = latest.map_or("shadow".to_string(), |r| r.mode.clone());
    ShadowStats {
        service: service.into(),
        bucket: bucket.into(),
        shadow_since: if mode == "shadow" { shadow_since } else { None },
        mode,
        window_start,
        window_end,
        last_report,
        coverage: (per_minute.len() as f64 / window_minutes).min(1.0),
        offered,
        virtual_dropped: vd,
        dropped,
        peak_drop_share: peak.0,
        peak_drop_at: peak.1,
        limit_rps: latest.map_or(0.0, |r| r.limit_rps),
        suggested_limit_rps: readiness::suggested_limit(
            &rates,
            readiness::SUGGESTED_LIMIT_DROP_SHARE,
        ),
    }
}

#[cfg(test)]
mod race_tests;
mod write;
