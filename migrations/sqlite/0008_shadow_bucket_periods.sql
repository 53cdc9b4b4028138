-- Bucket-wide hourly and daily roll-ups per (service, bucket), all scope keys together, the
-- same columns as the ten-minute `shadow_blocks` and upserted with them in the ingest
-- transaction: the overview tiles its window with the coarsest rows (a 30-day window reads 31
-- day rows a bucket instead of 4,320 blocks). Only sums, extrema and counts, so an upsert keeps
-- them exact however reports are batched. Times are integer unix milliseconds; days are UTC.
CREATE TABLE shadow_bucket_hours (
    service         TEXT NOT NULL,
    bucket          TEXT NOT NULL,
    hour            INTEGER NOT NULL,
    reports         INTEGER NOT NULL,
    enforce_reports INTEGER NOT NULL,
    offered         REAL NOT NULL,
    admitted        REAL NOT NULL,
    dropped         REAL NOT NULL,
    shadow_dropped  REAL NOT NULL,
    max_offered     REAL NOT NULL,
    max_drop_ratio  REAL NOT NULL,
    first_t         INTEGER NOT NULL,
    last_t          INTEGER NOT NULL,
    PRIMARY KEY (service, bucket, hour)
);
CREATE INDEX shadow_bucket_hours_hour ON shadow_bucket_hours (hour);

CREATE TABLE shadow_bucket_days (
    service         TEXT NOT NULL,
    bucket          TEXT NOT NULL,
    day             INTEGER NOT NULL,
    reports         INTEGER NOT NULL,
    enforce_reports INTEGER NOT NULL,
    offered         REAL NOT NULL,
    admitted        REAL NOT NULL,
    dropped         REAL NOT NULL,
    shadow_dropped  REAL NOT NULL,
    max_offered     REAL NOT NULL,
    max_drop_ratio  REAL NOT NULL,
    first_t         INTEGER NOT NULL,
    last_t          INTEGER NOT NULL,
    PRIMARY KEY (service, bucket, day)
);
CREATE INDEX shadow_bucket_days_day ON shadow_bucket_days (day);

-- The blocks stored so far keep counting in the overview.
INSERT INTO shadow_bucket_hours (service, bucket, hour, reports, enforce_reports, offered, admitted,
                                 dropped, shadow_dropped, max_offered, max_drop_ratio, first_t, last_t)
SELECT service, bucket, (block / 3600000) * 3600000, SUM(reports), SUM(enforce_reports),
       SUM(offered), SUM(admitted), SUM(dropped), SUM(shadow_dropped), MAX(max_offered),
       MAX(max_drop_ratio), MIN(first_t), MAX(last_t)
FROM shadow_blocks
GROUP BY service, bucket, (block / 3600000) * 3600000;

INSERT INTO shadow_bucket_days (service, bucket, day, reports, enforce_reports, offered, admitted,
                                dropped, shadow_dropped, max_offered, max_drop_ratio, first_t, last_t)
SELECT service, bucket, (block / 86400000) * 86400000, SUM(reports), SUM(enforce_reports),
       SUM(offered), SUM(admitted), SUM(dropped), SUM(shadow_dropped), MAX(max_offered),
       MAX(max_drop_ratio), MIN(first_t), MAX(last_t)
FROM shadow_blocks
GROUP BY service, bucket, (block / 86400000) * 86400000;
