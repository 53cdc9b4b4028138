//! The report writes: [`Store::insert_reports`] stores a batch and adds its new reports to
//! the per-minute and bucket-wide roll-ups; [`Store::roll_up_hours`] rolls closed minutes up
//! into `shadow_hours`; [`Store::apply_retention`] deletes what is past retention.

use std::sync::LazyLock;

use super::*;

/// Rows per SQLite multi-row statement (15 columns each, under SQLite's 32,766 variables).
const SQLITE_ROWS_PER_STATEMENT: usize = 1_000;
/// Rows per Postgres statement (arrays bound with UNNEST: no variable limit, bounded memory).
const PG_ROWS_PER_STATEMENT: usize = 10_000;

/// A roll-up increment computed from newly stored reports.
#[derive(Debug, Clone)]
struct Acc {
    reports: i64,
    offered: f64,
    admitted: f64,
    dropped: f64,
    shadow_dropped: f64,
    max_offered: f64,
    max_drop_ratio: f64,
    first_t: DateTime<Utc>,
    last_t: DateTime<Utc>,
    limit_rps: f64,
    mode: String,
    last_seq: i64,
}

type MinuteKey = (String, String, DateTime<Utc>, String);

/// A report ready to store.
struct Row<'a> {
    r: &'a ReportRow,
    t: DateTime<Utc>,
    scope: String,
    /// What the sums add: the requests the row counted when it says (controllers that send
    /// `counts`), else its rates (a row stands for one second).
    sums: [f64; 4],
}

impl<'a> Row<'a> {
    fn new(r: &'a ReportRow, t: DateTime<Utc>) -> Row<'a> {
        Row {
            r,
            t,
            scope: r.scope_key.clone(),
            sums: r.requests(),
        }
    }
}

fn rollup<'a>(rows: impl Iterator<Item = &'a Row<'a>>) -> BTreeMap<MinuteKey, Acc> {
    let mut m: BTreeMap<MinuteKey, Acc> = BTreeMap::new();
    for row in rows {
        let r = row.r;
        let key = (
            r.service.clone(),
            r.bucket.clone(),
            minute_of(row.t),
            row.scope.clone(),
        );
        let a = m.entry(key).or_insert_with(|| Acc {
            reports: 0,
            offered: 0.0,
            admitted: 0.0,
            dropped: 0.0,
            shadow_dropped: 0.0,
            max_offered: f64::MIN,
            max_drop_ratio: f64::MIN,
            first_t: row.t,
            last_t: row.t,
            limit_rps: r.limit_rps,
            mode: r.mode.to_string(),
            last_seq: i64::MIN,
        });
        a.reports += 1;
        a.offered += row.sums[0];
        a.admitted += row.sums[1];
        a.dropped += row.sums[2];
        a.shadow_dropped += row.sums[3];
        a.max_offered = a.max_offered.max(r.offered);
        a.max_drop_ratio = a.max_drop_ratio.max(r.drop_ratio);
        a.first_t = a.first_t.min(row.t);
        a.last_t = a.last_t.max(row.t);
        if seq_of(r) >= a.last_seq {
            a.last_seq = seq_of(r);
            a.limit_rps = r.limit_rps;
            a.mode = r.mode.to_string();
        }
    }
    m
}

/// The roll-up upsert: sums add up, maxima stay maxima, limit and mode follow the latest
/// report by sequence.
const UPSERT_SET: &str = " ON CONFLICT (service, bucket, minute, scope_key) DO UPDATE SET \
    reports = m.reports + excluded.reports, offered = m.offered + excluded.offered, \
    admitted = m.admitted + excluded.admitted, dropped = m.dropped + excluded.dropped, \
    shadow_dropped = m.shadow_dropped + excluded.shadow_dropped, \
    max_offered = CASE WHEN excluded.max_offered > m.max_offered THEN excluded.max_offered ELSE m.max_offered END, \
    max_drop_ratio = CASE WHEN excluded.max_drop_ratio > m.max_drop_ratio THEN excluded.max_drop_ratio ELSE m.max_drop_ratio END, \
    first_t = CASE WHEN excluded.first_t < m.first_t THEN excluded.first_t ELSE m.first_t END, \
    last_t = CASE WHEN excluded.last_t > m.last_t THEN excluded.last_t ELSE m.last_t END, \
    limit_rps = CASE WHEN excluded.last_seq >= m.last_seq THEN excluded.limit_rps ELSE m.limit_rps END, \
    mode = CASE WHEN excluded.last_seq >= m.last_seq THEN excluded.mode ELSE m.mode END, \
    last_seq = CASE WHEN excluded.last_seq > m.last_seq THEN excluded.last_seq ELSE m.last_seq END";

/// Closed dirty hours rolled up by one [`Store::roll_up_hours`] call at most (bounded work;
/// the next call goes on).
const HOURS_PER_PASS: i64 = 48;

/// Recomputes every `shadow_hours` row of the hour `[$1, $2)` from its minute rows (after
/// the old rows were deleted). Per scope key: sums, extrema, the per-minute average offered
/// rates above zero (count, sum, lowest, highest), the newest minute's limit and mode; per
/// bucket (in every scope key's row): minutes with a report and the peak per-minute
/// virtual-drop share (earliest minute on a tie).
const HOUR_ROLLUP: &str = "INSERT INTO shadow_hours (service, bucket, scope_key, hour, reports, offered, admitted, \
    dropped, shadow_dropped, max_offered, max_drop_ratio, first_t, last_t, rates, rate_sum, rate_min, rate_max, \
    max_vd_rps, max_drop_rps, last_minute, last_minute_t, limit_rps, mode, bucket_minutes, peak_share, peak_minute) \
    WITH m AS (SELECT * FROM shadow_minutes WHERE minute >= $1 AND minute < $2 AND reports > 0), \
    pm AS (SELECT service, bucket, minute, SUM(offered) AS o, SUM(shadow_dropped) AS v FROM m \
           GROUP BY service, bucket, minute), \
    bk AS (SELECT service, bucket, COUNT(*) AS minutes FROM pm GROUP BY service, bucket), \
    pk AS (SELECT service, bucket, minute, v / o AS share, \
                  ROW_NUMBER() OVER (PARTITION BY service, bucket ORDER BY v / o DESC, minute) AS rn \
           FROM pm WHERE o > 0 AND v / o > 0), \
    lt AS (SELECT service, bucket, scope_key, minute, last_t, limit_rps, mode, \
                  ROW_NUMBER() OVER (PARTITION BY service, bucket, scope_key ORDER BY minute DESC) AS rn FROM m), \
    s AS (SELECT service, bucket, scope_key, CAST(SUM(reports) AS BIGINT) AS reports, SUM(offered) AS offered, \
                 SUM(admitted) AS admitted, SUM(dropped) AS dropped, SUM(shadow_dropped) AS shadow_dropped, \
                 MAX(max_offered) AS max_offered, MAX(max_drop_ratio) AS max_drop_ratio, MIN(first_t) AS first_t, \
                 MAX(last_t) AS last_t, COUNT(CASE WHEN offered > 0 THEN 1 END) AS rates, \
                 COALESCE(SUM(CASE WHEN offered > 0 THEN offered / reports END), 0) AS rate_sum, \
                 COALESCE(MIN(CASE WHEN offered > 0 THEN offered / reports END), 0) AS rate_min, \
                 COALESCE(MAX(CASE WHEN offered > 0 THEN offered / reports END), 0) AS rate_max, \
                 MAX(shadow_dropped / reports) AS max_vd_rps, MAX(dropped / reports) AS max_drop_rps \
          FROM m GROUP BY service, bucket, scope_key) \
    SELECT s.service, s.bucket, s.scope_key, $1, s.reports, s.offered, s.admitted, s.dropped, s.shadow_dropped, \
           s.max_offered, s.max_drop_ratio, s.first_t, s.last_t, s.rates, s.rate_sum, s.rate_min, s.rate_max, \
           s.max_vd_rps, s.max_drop_rps, lt.minute, lt.last_t, lt.limit_rps, lt.mode, bk.minutes, \
           COALESCE(pk.share, 0), pk.minute \
    FROM s JOIN lt ON lt.service = s.service AND lt.bucket = s.bucket AND lt.scope_key = s.scope_key AND lt.rn = 1 \
    JOIN bk ON bk.service = s.service AND bk.bucket = s.bucket \
    LEFT JOIN pk ON pk.service = s.service AND pk.bucket = s.bucket AND pk.rn = 1";

/// An increment of a bucket-wide roll-up ([`Period`]) computed from newly stored reports
/// (SQLite; Postgres sums them in the insert statement).
#[derive(Debug, Clone)]
struct BlockAcc {
    reports: i64,
    enforce_reports: i64,
    offered: f64,
    admitted: f64,
    dropped: f64,
    shadow_dropped: f64,
    max_offered: f64,
    max_drop_ratio: f64,
    first_t: DateTime<Utc>,
    last_t: DateTime<Utc>,
}

type BlockKey = (String, String, DateTime<Utc>);

/// The new rows of a batch summed per (service, bucket) and `period` (SQLite).
fn period_rollup<'a>(
    rows: impl Iterator<Item = &'a Row<'a>>,
    period: Period,
) -> BTreeMap<BlockKey, BlockAcc> {
    let mut m: BTreeMap<BlockKey, BlockAcc> = BTreeMap::new();
    for row in rows {
        let r = row.r;
        let a = m
            .entry((r.service.clone(), r.bucket.clone(), period.of(row.t)))
            .or_insert_with(|| BlockAcc {
                reports: 0,
                enforce_reports: 0,
                offered: 0.0,
                admitted: 0.0,
                dropped: 0.0,
                shadow_dropped: 0.0,
                max_offered: f64::MIN,
                max_drop_ratio: f64::MIN,
                first_t: row.t,
                last_t: row.t,
            });
        a.reports += 1;
        a.enforce_reports += i64::from(r.mode == "enforce");
        a.offered += row.sums[0];
        a.admitted += row.sums[1];
        a.dropped += row.sums[2];
        a.shadow_dropped += row.sums[3];
        a.max_offered = a.max_offered.max(r.offered);
        a.max_drop_ratio = a.max_drop_ratio.max(r.drop_ratio);
        a.first_t = a.first_t.min(row.t);
        a.last_t = a.last_t.max(row.t);
    }
    m
}

/// `(service, bucket, minute)` of `shadow_tier_minutes`.
type TierKey<'a> = (&'a str, &'a str, DateTime<Utc>);

/// The tier counts of new rows summed per bucket and minute, in the order of
/// [`TIER_CELLS`] (SQLite).
fn tier_rollup<'a>(
    rows: impl Iterator<Item = &'a Row<'a>>,
) -> BTreeMap<TierKey<'a>, [f64; TIER_CELLS.len()]> {
    let mut m: BTreeMap<TierKey<'a>, [f64; TIER_CELLS.len()]> = BTreeMap::new();
    for row in rows {
        for t in tiers_of(row.r) {
            let key = (
                row.r.service.as_str(),
                row.r.bucket.as_str(),
                minute_of(row.t),
            );
            let sum = m.entry(key).or_insert([0.0; TIER_CELLS.len()]);
            let at = t.tier as usize * 3;
            for (s, x) in sum[at..at + 3].iter_mut().zip(tier_counts(t)) {
                *s += x;
            }
        }
    }
    m
}

/// The tier entries of a report row (none from controllers that send no tiers).
fn tiers_of(r: &ReportRow) -> &[grl_wire::TierCountsMsg] {
    r.counts.as_ref().map_or(&[], |c| c.tiers.as_slice())
}

/// Each row's tier entries, one element each (Postgres sums them into one row per bucket
/// and minute: one upsert whatever the number of tiers).
fn tier_entries<'a>(chunk: &'a [Row<'a>]) -> Vec<(&'a Row<'a>, &'a grl_wire::TierCountsMsg)> {
    chunk
        .iter()
        .flat_map(|x| tiers_of(x.r).iter().map(move |t| (x, t)))
        .collect()
}

/// `[offered, dropped, shadow_dropped]` of a tier entry (admitted is offered less dropped).
fn tier_counts(t: &grl_wire::TierCountsMsg) -> [f64; 3] {
    [t.offered, t.dropped, t.shadow_dropped].map(|n| n as f64)
}

/// `shadow_tier_minutes`' key and cells, as one column list.
static TIER_COLUMNS: LazyLock<String> =
    LazyLock::new(|| format!("service, bucket, minute, {}", TIER_CELLS.join(", ")));

/// The tier roll-up upsert: every cell adds up.
static TIER_UPSERT_SET: LazyLock<String> = LazyLock::new(|| {
    let sets: Vec<String> = TIER_CELLS
        .iter()
        .map(|c| format!("{c} = m.{c} + excluded.{c}"))
        .collect();
    format!(
        " ON CONFLICT (service, bucket, minute) DO UPDATE SET {}",
        sets.join(", ")
    )
});

/// The cells of `shadow_tier_minutes` summed from `tin` (one element per report row and
/// tier; Postgres).
static TIER_PIVOT: LazyLock<String> = LazyLock::new(|| {
    let sums: Vec<String> = schema::Criticality::ALL
        .iter()
        .flat_map(|t| {
            ["offered", "dropped", "shadow_dropped"].map(|m| {
                format!(
                    "SUM(CASE WHEN tin.tier = '{}' THEN tin.{m} ELSE 0 END)",
                    t.as_str()
                )
            })
        })
        .collect();
    sums.join(", ")
});

const MINUTE_COLUMNS: &str = "service, bucket, scope_key, minute, reports, offered, admitted, dropped, shadow_dropped, max_offered, max_drop_ratio, first_t, last_t, limit_rps, mode, last_seq";
const REPORT_COLUMNS: &str = "seq, t, service, bucket, caller, procedure, mode, scope_key, offered, admitted, dropped, shadow_dropped, limit_rps, drop_ratio, received_at, offered_rate";

impl Store {
    /// Stores reports of any mode (duplicates by seq/service/bucket/scope key are ignored) and
    /// adds the new ones to the per-minute roll-ups, in one transaction; returns how many
    /// were new. Batched: multi-row statements on SQLite, arrays with `UNNEST` on Postgres.
    pub async fn insert_reports(
        &self,
        reports: &[ReportRow],
        received_at: DateTime<Utc>,
    ) -> Result<u64, StoreError> {
        // A row given twice in one batch is stored and counted once (as one given again in a
        // later batch is), in every roll-up and on both backends.
        let mut keys = HashSet::with_capacity(reports.len());
        let rows: Vec<Row> = reports
            .iter()
            .filter(|r| keys.insert((seq_of(r), &r.service, &r.bucket, &r.scope_key)))
            .map(|r| Row::new(r, tick_time(&r.t, received_at)))
            .collect();
        let mut new = 0u64;
        // Every hour the batch writes minutes in is marked dirty (before the minutes are
        // written: the mark's row lock makes a concurrent roll-up pass of that hour wait for
        // this transaction, so it sees these minutes).
        let hours: Vec<Ts> = rows
            .iter()
            .map(|x| hour_of(x.t))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .map(Ts)
            .collect();
        match self {
            Store::Postgres(pool) => new = pg_insert(pool, &rows, &hours, received_at).await?,
            Store::Sqlite(pool, file) => {
                if let Some(f) = file {
                    f.check()?;
                }
                let mut tx = pool.begin().await?;
                if !hours.is_empty() {
                    let mut q = sqlx::QueryBuilder::<Sqlite>::new(
                        "INSERT INTO shadow_dirty_hours AS d (hour, marks) ",
                    );
                    q.push_values(&hours, |mut b, h| {
                        b.push_bind(*h).push_bind(1i64);
                    });
                    q.push(" ON CONFLICT (hour) DO UPDATE SET marks = d.marks + 1");
                    q.build().execute(&mut *tx).await?;
                }
                for chunk in rows.chunks(SQLITE_ROWS_PER_STATEMENT) {
                    let mut q = sqlx::QueryBuilder::<Sqlite>::new(format!(
                        "INSERT INTO shadow_reports ({REPORT_COLUMNS}) "
                    ));
                    q.push_values(chunk, |mut b, x| {
                        b.push_bind(seq_of(x.r))
                            .push_bind(Ts(x.t))
                            .push_bind(&x.r.service)
                            .push_bind(&x.r.bucket)
                            .push_bind(&x.r.caller)
                            .push_bind(&x.r.procedure)
                            .push_bind(x.r.mode.as_ref())
                            .push_bind(&x.scope)
                            .push_bind(x.sums[0])
                            .push_bind(x.sums[1])
                            .push_bind(x.sums[2])
                            .push_bind(x.sums[3])
                            .push_bind(x.r.limit_rps)
                            .push_bind(x.r.drop_ratio)
                            .push_bind(Ts(received_at))
                            .push_bind(x.r.offered);
                    });
                    q.push(
                        " ON CONFLICT (seq, service, bucket, scope_key) DO NOTHING \
                         RETURNING seq, service, bucket, scope_key",
                    );
                    let inserted: Vec<(i64, String, String, String)> =
                        q.build_query_as().fetch_all(&mut *tx).await?;
                    new += inserted.len() as u64;
                    let fresh: Vec<&Row> = only_new(chunk, inserted).collect();
                    if fresh.is_empty() {
                        continue;
                    }
                    let acc = rollup(fresh.iter().copied());
                    let v: Vec<(&MinuteKey, &Acc)> = acc.iter().collect();
                    let mut q = sqlx::QueryBuilder::<Sqlite>::new(format!(
                        "INSERT INTO shadow_minutes AS m ({MINUTE_COLUMNS}) "
                    ));
                    q.push_values(v, |mut b, (k, a)| {
                        b.push_bind(k.0.as_str())
                            .push_bind(k.1.as_str())
                            .push_bind(k.3.as_str())
                            .push_bind(Ts(k.2))
                            .push_bind(a.reports)
                            .push_bind(a.offered)
                            .push_bind(a.admitted)
                            .push_bind(a.dropped)
                            .push_bind(a.shadow_dropped)
                            .push_bind(a.max_offered)
                            .push_bind(a.max_drop_ratio)
                            .push_bind(Ts(a.first_t))
                            .push_bind(Ts(a.last_t))
                            .push_bind(a.limit_rps)
                            .push_bind(a.mode.as_str())
                            .push_bind(a.last_seq);
                    });
                    q.push(UPSERT_SET);
                    q.build().execute(&mut *tx).await?;
                    sqlite_upsert_tiers(&mut tx, &fresh).await?;
                    for period in PERIODS {
                        let acc = period_rollup(fresh.iter().copied(), period);
                        let mut q = sqlx::QueryBuilder::<Sqlite>::new(format!(
                            "INSERT INTO {} AS b ({}) ",
                            period.table,
                            period.columns()
                        ));
                        q.push_values(acc.iter(), |mut b, ((service, bucket, start), a)| {
                            b.push_bind(service.as_str())
                                .push_bind(bucket.as_str())
                                .push_bind(Ts(*start))
                                .push_bind(a.reports)
                                .push_bind(a.enforce_reports)
                                .push_bind(a.offered)
                                .push_bind(a.admitted)
                                .push_bind(a.dropped)
                                .push_bind(a.shadow_dropped)
                                .push_bind(a.max_offered)
                                .push_bind(a.max_drop_ratio)
                                .push_bind(Ts(a.first_t))
                                .push_bind(Ts(a.last_t));
                        });
                        q.push(period.upsert_set());
                        q.build().execute(&mut *tx).await?;
                    }
                }
                tx.commit().await?;
            }
        }
        Ok(new)
    }

    /// Deletes full-resolution reports with a tick before `raw_before` and minute roll-ups
    /// before `minutes_before`.
    pub async fn apply_retention(
        &self,
        raw_before: DateTime<Utc>,
        minutes_before: DateTime<Utc>,
    ) -> Result<Retained, StoreError> {
        on_pool!(self, pool => {
            let raw_deleted = sqlx::query("DELETE FROM shadow_reports WHERE t < $1")
                .bind(Ts(raw_before))
                .execute(pool)
                .await?
                .rows_affected();
            let minutes_deleted = sqlx::query("DELETE FROM shadow_minutes WHERE minute < $1")
                .bind(Ts(minutes_before))
                .execute(pool)
                .await?
                .rows_affected();
            sqlx::query("DELETE FROM shadow_tier_minutes WHERE minute < $1")
                .bind(Ts(minutes_before))
                .execute(pool)
                .await?;
            // A roll-up row goes once every minute of its period is before the retention.
            let mut periods_deleted = [0u64; PERIODS.len()];
            for (deleted, p) in periods_deleted.iter_mut().zip(PERIODS) {
                *deleted = sqlx::query(&format!("DELETE FROM {} WHERE {} <= $1", p.table, p.column))
                    .bind(Ts(minutes_before - Duration::seconds(p.secs)))
                    .execute(pool)
                    .await?
                    .rows_affected();
            }
            let [blocks_deleted, bucket_hours_deleted, bucket_days_deleted] = periods_deleted;
            let hour_end = Ts(minutes_before - Duration::seconds(HOUR_SECS));
            let hours_deleted = sqlx::query("DELETE FROM shadow_hours WHERE hour <= $1")
                .bind(hour_end)
                .execute(pool)
                .await?
                .rows_affected();
            // Marks of hours whose minutes are gone: nothing left to roll up.
            sqlx::query("DELETE FROM shadow_dirty_hours WHERE hour <= $1")
                .bind(hour_end)
                .execute(pool)
                .await?;
            Ok(Retained {
                raw_deleted,
                minutes_deleted,
                blocks_deleted,
                hours_deleted,
                bucket_hours_deleted,
                bucket_days_deleted,
            })
        })
    }

    /// Rolls the minutes of closed dirty hours (before the hour of `now`) up into
    /// `shadow_hours`, oldest first, at most `HOURS_PER_PASS` of them, each in its own
    /// transaction: the mark is deleted first (waiting for an ingest that holds it), then the
    /// hour's rows are recomputed from its minutes. Returns how many hours were rolled up.
    pub async fn roll_up_hours(&self, now: DateTime<Utc>) -> Result<u64, StoreError> {
        let closed = Ts(hour_of(now));
        on_pool!(self, pool => {
            let hours: Vec<(Ts,)> = sqlx::query_as(
                "SELECT hour FROM shadow_dirty_hours WHERE hour < $1 ORDER BY hour LIMIT $2",
            )
            .bind(closed)
            .bind(HOURS_PER_PASS)
            .fetch_all(pool)
            .await?;
            let mut done = 0;
            for (h,) in hours {
                let mut tx = pool.begin().await?;
                let gone = sqlx::query("DELETE FROM shadow_dirty_hours WHERE hour = $1")
                    .bind(h)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                if gone == 0 {
                    continue; // another replica's pass took it
                }
                sqlx::query("DELETE FROM shadow_hours WHERE hour = $1")
                    .bind(h)
                    .execute(&mut *tx)
                    .await?;
                sqlx::query(HOUR_ROLLUP)
                    .bind(h)
                    .bind(Ts(h.0 + Duration::seconds(HOUR_SECS)))
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                done += 1;
            }
            Ok(done)
        })
    }
}

/// [`Store::insert_reports`] on Postgres: one statement per chunk inserts the rows from
/// arrays and upserts the roll-ups of the new ones; returns how many were new.
async fn pg_insert(
    pool: &sqlx::PgPool,
    rows: &[Row<'_>],
    hours: &[Ts],
    received_at: DateTime<Utc>,
) -> Result<u64, StoreError> {
    let mut new = 0u64;
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO shadow_dirty_hours AS d (hour, marks) SELECT h, 1 FROM UNNEST($1::timestamptz[]) h \
         ON CONFLICT (hour) DO UPDATE SET marks = d.marks + 1",
    )
    .bind(hours)
    .execute(&mut *tx)
    .await?;
    let periods = PERIODS
        .iter()
        .enumerate()
        .map(|(i, p)| p.pg_upsert_cte(&format!("p{i}")))
        .collect::<Vec<_>>()
        .join(", ");
    for chunk in rows.chunks(PG_ROWS_PER_STATEMENT) {
        let tiered = tier_entries(chunk);
        // One statement: the new rows (RETURNING) are summed per minute and upserted
        // into the roll-ups inside Postgres, without a round trip.
        let (inserted,): (i64,) = sqlx::query_as(&format!(
            "WITH ins AS (INSERT INTO shadow_reports ({REPORT_COLUMNS}) \
             SELECT * FROM UNNEST($1::bigint[], $2::timestamptz[], $3::text[], $4::text[], $5::text[], \
             $6::text[], $7::text[], $8::text[], $9::float8[], $10::float8[], $11::float8[], \
             $12::float8[], $13::float8[], $14::float8[], $15::timestamptz[], $16::float8[]) \
             ON CONFLICT (seq, service, bucket, scope_key) DO NOTHING \
             RETURNING seq, t, service, bucket, scope_key, mode, offered, admitted, dropped, \
                       shadow_dropped, limit_rps, drop_ratio, \
                       COALESCE(offered_rate, offered) AS rate), \
             up AS (INSERT INTO shadow_minutes AS m ({MINUTE_COLUMNS}) \
             SELECT service, bucket, scope_key, date_trunc('minute', t AT TIME ZONE 'UTC') AT TIME ZONE 'UTC', \
                    COUNT(*), SUM(offered), SUM(admitted), SUM(dropped), SUM(shadow_dropped), \
                    MAX(rate), MAX(drop_ratio), MIN(t), MAX(t), \
                    (array_agg(limit_rps ORDER BY seq DESC))[1], (array_agg(mode ORDER BY seq DESC))[1], \
                    MAX(seq) \
             FROM ins GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 4, 3{UPSERT_SET}), \
             tin AS (SELECT * FROM UNNEST($17::bigint[], $18::text[], $19::text[], $20::text[], \
             $21::timestamptz[], $22::text[], $23::float8[], $24::float8[], $25::float8[]) \
             AS x(seq, service, bucket, scope_key, t, tier, offered, dropped, shadow_dropped)), \
             tup AS (INSERT INTO shadow_tier_minutes AS m ({columns}) \
             SELECT tin.service, tin.bucket, date_trunc('minute', tin.t AT TIME ZONE 'UTC') AT TIME ZONE 'UTC', \
                    {pivot} \
             FROM tin JOIN ins ON ins.seq = tin.seq AND ins.service = tin.service \
                  AND ins.bucket = tin.bucket AND ins.scope_key = tin.scope_key \
             GROUP BY 1, 2, 3 ORDER BY 1, 2, 3{tier_set}), \
             {periods} \
             SELECT COUNT(*) FROM ins",
            columns = *TIER_COLUMNS,
            pivot = *TIER_PIVOT,
            tier_set = *TIER_UPSERT_SET,
        ))
        .bind(chunk.iter().map(|x| seq_of(x.r)).collect::<Vec<_>>())
        .bind(chunk.iter().map(|x| x.t).collect::<Vec<_>>())
        .bind(chunk.iter().map(|x| x.r.service.as_str()).collect::<Vec<_>>())
        .bind(chunk.iter().map(|x| x.r.bucket.as_str()).collect::<Vec<_>>())
        .bind(chunk.iter().map(|x| x.r.caller.as_deref()).collect::<Vec<_>>())
        .bind(chunk.iter().map(|x| x.r.procedure.as_deref()).collect::<Vec<_>>())
        .bind(chunk.iter().map(|x| x.r.mode.as_ref()).collect::<Vec<_>>())
        .bind(chunk.iter().map(|x| x.scope.as_str()).collect::<Vec<_>>())
        .bind(chunk.iter().map(|x| x.sums[0]).collect::<Vec<_>>())
        .bind(chunk.iter().map(|x| x.sums[1]).collect::<Vec<_>>())
        .bind(chunk.iter().map(|x| x.sums[2]).collect::<Vec<_>>())
        .bind(chunk.iter().map(|x| x.sums[3]).collect::<Vec<_>>())
        .bind(chunk.iter().map(|x| x.r.limit_rps).collect::<Vec<_>>())
        .bind(chunk.iter().map(|x| x.r.drop_ratio).collect::<Vec<_>>())
        .bind(vec![received_at; chunk.len()])
        .bind(chunk.iter().map(|x| x.r.offered).collect::<Vec<_>>())
        .bind(tiered.iter().map(|(x, _)| seq_of(x.r)).collect::<Vec<_>>())
        .bind(tiered.iter().map(|(x, _)| x.r.service.as_str()).collect::<Vec<_>>())
        .bind(tiered.iter().map(|(x, _)| x.r.bucket.as_str()).collect::<Vec<_>>())
        .bind(tiered.iter().map(|(x, _)| x.scope.as_str()).collect::<Vec<_>>())
        .bind(tiered.iter().map(|(x, _)| x.t).collect::<Vec<_>>())
        .bind(tiered.iter().map(|(_, t)| t.tier.as_str()).collect::<Vec<_>>())
        .bind(tiered.iter().map(|(_, t)| tier_counts(t)[0]).collect::<Vec<_>>())
        .bind(tiered.iter().map(|(_, t)| tier_counts(t)[1]).collect::<Vec<_>>())
        .bind(tiered.iter().map(|(_, t)| tier_counts(t)[2]).collect::<Vec<_>>())
        .fetch_one(&mut *tx)
        .await?;
        new += inserted as u64;
    }
    tx.commit().await?;
    Ok(new)
}

/// Adds the tier counts of `fresh` (new rows) to `shadow_tier_minutes` (SQLite).
async fn sqlite_upsert_tiers(
    tx: &mut sqlx::Transaction<'_, Sqlite>,
    fresh: &[&Row<'_>],
) -> Result<(), StoreError> {
    let tiers = tier_rollup(fresh.iter().copied());
    if tiers.is_empty() {
        return Ok(());
    }
    let mut q = sqlx::QueryBuilder::<Sqlite>::new(format!(
        "INSERT INTO shadow_tier_minutes AS m ({}) ",
        *TIER_COLUMNS
    ));
    q.push_values(tiers, |mut b, ((service, bucket, minute), cells)| {
        b.push_bind(service).push_bind(bucket).push_bind(Ts(minute));
        for c in cells {
            b.push_bind(c);
        }
    });
    q.push(TIER_UPSERT_SET.as_str());
    q.build().execute(&mut **tx).await?;
    Ok(())
}

/// Keeps the rows of `chunk` whose keys the insert reported as new.
fn only_new<'a>(
    chunk: &'a [Row<'a>],
    inserted: Vec<(i64, String, String, String)>,
) -> impl Iterator<Item = &'a Row<'a>> {
    let keys: HashSet<(i64, String, String, String)> = inserted.into_iter().collect();
    chunk.iter().filter(move |x| {
        keys.contains(&(
            seq_of(x.r),
            x.r.service.clone(),
            x.r.bucket.clone(),
            x.scope.clone(),
        ))
    })
}
