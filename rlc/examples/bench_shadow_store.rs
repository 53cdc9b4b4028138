//! Benchmark of the report store and the dashboard on a throwaway Postgres
//! (docs/rlc-dashboard.md).
//!
//! `cargo run --release -p rlc --example bench_shadow_store -- [BUCKETS] [SECONDS] [DAYS]`
//! (defaults 10000, 10, 30; DAYS 0 measures the ingest only):
//!
//! 1. ingest: every simulated second, one report per bucket and zone (3 zones) goes through
//!    `Store::insert_reports` (raw rows plus the per-minute roll-up upsert), as `rlc serve`
//!    stores a controller page; prints rows/s;
//! 2. dashboard: fills `shadow_minutes` with DAYS of minutes for 10 buckets and the last hour
//!    for every bucket (SQL `generate_series`), `shadow_blocks` from them and `shadow_hours`
//!    by the hourly roll-up pass (timed); then the bucket-wide roll-ups of every bucket over
//!    DAYS (`shadow_blocks`, and `shadow_bucket_hours` and `shadow_bucket_days` where the
//!    schema has them: a base build without them runs the same fill), as ingest would have
//!    written them in DAYS of reports, in time order (43 million blocks at 10,000 buckets and 30 days; the
//!    minutes of all of them, 1.3 billion rows, would not fit this machine's disk, and no
//!    overview reads them); then times `GET /buckets/{s}/{b}?window=DAYSd`, its JSON twin and
//!    the overview `GET /?window=W` and `GET /v1/shadow?window=W` for every window of the
//!    dashboard's menu (15m to 30d) over real HTTP (median of 5).
//!
//! Starts its own Postgres (test-support; or `DATABASE_URL`).

use std::path::Path;
use std::time::{Duration, Instant};

use chrono::Utc;
use grl_wire::ReportRow as Report;
use rlc::serve::{app, AppState};
use rlc::store::{block_of, minute_of, Store};

fn report(seq: i64, t: i64, b: usize, zone: usize) -> Report {
    let offered = 50.0 + (b % 97) as f64;
    let limit = 120.0;
    let over = (offered - limit).max(0.0);
    // The counts of a controller whose clients count tiers: 40 % CRITICAL, the rest
    // SHEDDABLE, which takes the virtual drops.
    let (o, v) = (offered as u64, over as u64);
    let crit = o * 2 / 5;
    serde_json::from_value(serde_json::json!({
        "seq": seq, "t": t, "service": format!("svc-{}", b / 20), "bucket": format!("b-{b}"),
        "caller": null, "procedure": null, "mode": if b.is_multiple_of(2) { "shadow" } else { "enforce" },
        "scope_key": format!("z{zone}"), "offered": offered, "admitted": offered,
        "dropped": 0.0, "shadow_dropped": over, "limit_rps": limit, "drop_ratio": over / offered,
        "counts": {"offered": o, "admitted": o, "dropped": 0, "shadow_dropped": v, "tiers": [
            {"tier": "SHEDDABLE", "offered": o - crit, "admitted": o - crit, "dropped": 0, "shadow_dropped": v},
            {"tier": "CRITICAL", "offered": crit, "admitted": crit, "dropped": 0, "shadow_dropped": 0}
        ]}
    }))
    .unwrap()
}

/// The 10 charted buckets' requests by tier over DAYS, where the schema has them (a base
/// build without them runs the same fill): one row a minute with two tiers, every scope key
/// together, as ingest writes them.
async fn fill_tiers(
    pool: &sqlx::PgPool,
    now: chrono::DateTime<Utc>,
    days: i64,
) -> anyhow::Result<()> {
    if tiered_schema(pool).await? {
        sqlx::query(
            "INSERT INTO shadow_tier_minutes (service, bucket, minute, critical_offered, sheddable_offered) \
             SELECT 'svc-' || (b / 20), 'b-' || b, m, 0.4 * 3 * (6000 + (b % 97) * 60), \
                    0.6 * 3 * (6000 + (b % 97) * 60) \
             FROM generate_series(0, 9) b, \
                  generate_series($1::timestamptz - make_interval(mins => $2::int), $1::timestamptz, interval '1 minute') m \
             ON CONFLICT DO NOTHING",
        )
        .bind(now)
        .bind((days * 1440) as i32)
        .execute(pool)
        .await?;
    }
    Ok(())
}

/// Times the critical peaks a plan reads over the window (rlc's `critical_headroom`), median
/// of 5, where the schema has the tier rows.
async fn time_critical_peaks(
    store: &Store,
    pool: &sqlx::PgPool,
    now: chrono::DateTime<Utc>,
    days: i64,
) -> anyhow::Result<()> {
    if !tiered_schema(pool).await? {
        return Ok(());
    }
    let mut times = Vec::new();
    let mut found = 0;
    for _ in 0..5 {
        let t = Instant::now();
        found = store
            .critical_peaks(now - chrono::Duration::days(days))
            .await?
            .len();
        times.push(t.elapsed());
    }
    times.sort();
    println!(
        "critical peaks over {days} d: {found} buckets in {} ms (median of 5)",
        times[2].as_millis()
    );
    Ok(())
}

/// Whether the store's schema has the tier rows (a base build may not).
async fn tiered_schema(pool: &sqlx::PgPool) -> anyhow::Result<bool> {
    let (tiered,): (bool,) =
        sqlx::query_as("SELECT to_regclass('shadow_tier_minutes') IS NOT NULL")
            .fetch_one(pool)
            .await?;
    Ok(tiered)
}

async fn median_get(http: &reqwest::Client, url: &str) -> anyhow::Result<(Duration, usize)> {
    let mut times = Vec::new();
    let mut size = 0;
    for _ in 0..5 {
        let t = Instant::now();
        let r = http.get(url).send().await?;
        anyhow::ensure!(r.status().is_success(), "{url}: {}", r.status());
        size = r.bytes().await?.len();
        times.push(t.elapsed());
    }
    times.sort();
    Ok((times[2], size))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let buckets: usize = args
        .next()
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(10_000);
    let seconds: i64 = args.next().map(|a| a.parse()).transpose()?.unwrap_or(10);
    let days: i64 = args.next().map(|a| a.parse()).transpose()?.unwrap_or(30);
    let db = test_support::postgres::fresh_database().await?;
    let store = Store::connect(&db.url, Path::new("/")).await?;
    let pool = sqlx::PgPool::connect(&db.url).await?;

    // 1. Ingest.
    let start = Utc::now().timestamp() - seconds;
    let mut seq = 0;
    let mut total = Duration::ZERO;
    let mut worst = Duration::ZERO;
    let mut rows = 0;
    for s in 0..seconds {
        let page: Vec<Report> = (0..buckets)
            .flat_map(|b| (0..3).map(move |z| (b, z)))
            .map(|(b, z)| {
                seq += 1;
                report(seq, start + s, b, z)
            })
            .collect();
        let t = Instant::now();
        rows += store.insert_reports(&page, Utc::now()).await?;
        let e = t.elapsed();
        total += e;
        worst = worst.max(e);
    }
    println!(
        "ingest: {rows} rows ({buckets} buckets x 3 zones x {seconds} s) in {:.2} s: {:.0} rows/s (slowest second: {} ms)",
        total.as_secs_f64(),
        rows as f64 / total.as_secs_f64(),
        worst.as_millis()
    );

    if days == 0 {
        return Ok(());
    }
    // 2. Roll-ups: DAYS of minutes for 10 buckets, the last hour for every bucket.
    let now = minute_of(Utc::now());
    let t = Instant::now();
    let fill = "INSERT INTO shadow_minutes (service, bucket, scope_key, minute, reports, offered, admitted, dropped, \
                shadow_dropped, max_offered, max_drop_ratio, first_t, last_t, limit_rps, mode, last_seq) \
                SELECT 'svc-' || (b / 20), 'b-' || b, 'z' || z, m, 60, 6000 + (b % 97) * 60, 6000, 0, \
                       CASE WHEN b % 97 > 70 THEN (b % 97 - 70) * 60 ELSE 0 END, 100 + b % 97, 0, m, \
                       m + interval '59 seconds', 170, 'shadow', 0 \
                FROM generate_series(0, $1::int - 1) b, generate_series(0, 2) z, \
                     generate_series($2::timestamptz - make_interval(mins => $3::int), $2::timestamptz, interval '1 minute') m \
                ON CONFLICT DO NOTHING";
    sqlx::query(fill)
        .bind(10i32)
        .bind(now)
        .bind((days * 1440) as i32)
        .execute(&pool)
        .await?;
    sqlx::query(fill)
        .bind(buckets as i32)
        .bind(now)
        .bind(60i32)
        .execute(&pool)
        .await?;
    fill_tiers(&pool, now, days).await?;
    // The ten-minute roll-ups of what was filled (ingest writes them with the minutes; the
    // fill above bypassed it): rebuilt from the minutes, as migration 0005 does.
    sqlx::query("DELETE FROM shadow_blocks")
        .execute(&pool)
        .await?;
    sqlx::query(
        "INSERT INTO shadow_blocks (service, bucket, block, reports, enforce_reports, offered, admitted, \
         dropped, shadow_dropped, max_offered, max_drop_ratio, first_t, last_t) \
         SELECT service, bucket, to_timestamp(floor(extract(epoch FROM minute) / 600) * 600), SUM(reports), \
                COALESCE(SUM(reports) FILTER (WHERE mode = 'enforce'), 0), SUM(offered), SUM(admitted), \
                SUM(dropped), SUM(shadow_dropped), MAX(max_offered), MAX(max_drop_ratio), MIN(first_t), MAX(last_t) \
         FROM shadow_minutes GROUP BY 1, 2, 3",
    )
    .execute(&pool)
    .await?;
    // The hourly roll-ups: the filled hours are marked dirty (as ingest marks them) and
    // rolled up by the pass `rlc serve` runs every minute (closed hours only).
    sqlx::query(
        "INSERT INTO shadow_dirty_hours (hour, marks) \
         SELECT DISTINCT date_trunc('hour', minute AT TIME ZONE 'UTC') AT TIME ZONE 'UTC', 1 FROM shadow_minutes \
         ON CONFLICT (hour) DO NOTHING",
    )
    .execute(&pool)
    .await?;
    // Statistics as a live table has them (autovacuum keeps them; the fill above bypassed it).
    sqlx::query("ANALYZE").execute(&pool).await?;
    let pass = Instant::now();
    let mut hours = 0;
    loop {
        let n = store.roll_up_hours(Utc::now()).await?;
        if n == 0 {
            break;
        }
        hours += n;
    }
    println!(
        "hourly roll-ups: {hours} hours rolled up in {:.1} s",
        pass.elapsed().as_secs_f64()
    );
    sqlx::query("ANALYZE").execute(&pool).await?;
    let (n,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM shadow_minutes")
        .fetch_one(&pool)
        .await?;
    println!(
        "roll-ups: {n} rows ({days} d x 3 zones for 10 buckets, 1 h x 3 zones for {buckets}) written in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    // The bucket-wide roll-ups of every bucket over DAYS, before the hour filled above. Ingest
    // writes every bucket's row of a period within that period, so the rows of one period lie
    // together on disk: the fill writes them in time order (a day per statement), and the
    // hours and days below too. (Written bucket by bucket instead, a 24-hour overview read
    // 230,000 hour rows from as many pages.)
    let t = Instant::now();
    let last = now - chrono::Duration::hours(1);
    let mut day = block_of(now) - chrono::Duration::days(days);
    while day <= last {
        let end = (day + chrono::Duration::days(1) - chrono::Duration::seconds(1)).min(last);
        sqlx::query(
            "INSERT INTO shadow_blocks (service, bucket, block, reports, enforce_reports, offered, admitted, \
             dropped, shadow_dropped, max_offered, max_drop_ratio, first_t, last_t) \
             SELECT 'svc-' || (b / 20), 'b-' || b, k, 1800, 0, 180000 + (b % 97) * 1800, 180000, 0, \
                    CASE WHEN b % 97 > 70 THEN (b % 97 - 70) * 1800 ELSE 0 END, 100 + b % 97, 0, k, \
                    k + interval '599 seconds' \
             FROM generate_series(0, $1::int - 1) b, \
                  generate_series($2::timestamptz, $3::timestamptz, interval '10 minutes') k \
             ORDER BY k, b \
             ON CONFLICT DO NOTHING",
        )
        .bind(buckets as i32)
        .bind(day)
        .bind(end)
        .execute(&pool)
        .await?;
        day += chrono::Duration::days(1);
    }
    for (table, column, secs) in [
        ("shadow_bucket_hours", "hour", 3600),
        ("shadow_bucket_days", "day", 86_400),
    ] {
        let (exists,): (bool,) = sqlx::query_as("SELECT to_regclass($1) IS NOT NULL")
            .bind(table)
            .fetch_one(&pool)
            .await?;
        if !exists {
            println!("(no {table} in this schema)");
            continue;
        }
        sqlx::query(&format!("DELETE FROM {table}"))
            .execute(&pool)
            .await?;
        sqlx::query(&format!(
            "INSERT INTO {table} (service, bucket, {column}, reports, enforce_reports, offered, admitted, \
             dropped, shadow_dropped, max_offered, max_drop_ratio, first_t, last_t) \
             SELECT service, bucket, to_timestamp(floor(extract(epoch FROM block) / {secs}) * {secs}), \
                    SUM(reports), SUM(enforce_reports), SUM(offered), SUM(admitted), SUM(dropped), \
                    SUM(shadow_dropped), MAX(max_offered), MAX(max_drop_ratio), MIN(first_t), MAX(last_t) \
             FROM shadow_blocks GROUP BY 1, 2, 3 ORDER BY 3, 1, 2"
        ))
        .execute(&pool)
        .await?;
    }
    sqlx::query("VACUUM ANALYZE").execute(&pool).await?;
    let mut counts = Vec::new();
    for table in ["shadow_blocks", "shadow_bucket_hours", "shadow_bucket_days"] {
        if let Ok((n,)) = sqlx::query_as::<_, (i64,)>(&format!("SELECT COUNT(*) FROM {table}"))
            .fetch_one(&pool)
            .await
        {
            counts.push(format!("{table} {n}"));
        }
    }
    println!(
        "bucket-wide roll-ups of {buckets} buckets over {days} d: {} rows, written in {:.1} s",
        counts.join(", "),
        t.elapsed().as_secs_f64()
    );

    time_critical_peaks(&store, &pool, now, days).await?;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move {
        let _ = axum::serve(listener, app(AppState::with_store(store))).await;
    });
    let http = reqwest::Client::new();
    let mut paths = vec![
        format!("/buckets/svc-0/b-0?window={days}d"),
        format!("/v1/shadow/svc-0/b-0?window={days}d"),
    ];
    for w in ["15m", "1h", "6h", "24h", "7d", "30d"] {
        paths.push(format!("/?window={w}"));
        paths.push(format!("/v1/shadow?window={w}"));
    }
    for path in paths {
        let (t, size) = median_get(&http, &format!("{base}{path}")).await?;
        println!(
            "GET {path}: {} ms (median of 5, {} KiB)",
            t.as_millis(),
            size / 1024
        );
    }
    Ok(())
}
