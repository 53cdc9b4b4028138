-- Bucket-wide hourly and daily roll-ups per (service, bucket), all scope keys together, the
-- same columns as the ten-minute `shadow_blocks` and upserted with them in the ingest
-- statement: the overview tiles its window with the coarsest rows (a 30-day window reads 31
-- day rows a bucket instead of 4,320 blocks; at 10,000 buckets 310,000 rows instead of 43
-- million). Only sums, extrema and counts, so an upsert keeps them exact however reports are
-- batched, and the current hour's and day's rows hold everything stored up to now.
CREATE TABLE shadow_bucket_hours (
    service         TEXT NOT NULL,
    bucket          TEXT NOT NULL,
    hour            TIMESTAMPTZ NOT NULL,
    reports         BIGINT NOT NULL,
    enforce_reports BIGINT NOT NULL,
    offered         DOUBLE PRECISION NOT NULL,
    admitted        DOUBLE PRECISION NOT NULL,
    dropped         DOUBLE PRECISION NOT NULL,
    shadow_dropped  DOUBLE PRECISION NOT NULL,
    max_offered     DOUBLE PRECISION NOT NULL,
    max_drop_ratio  DOUBLE PRECISION NOT NULL,
    first_t         TIMESTAMPTZ NOT NULL,
    last_t          TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (service, bucket, hour)
) WITH (fillfactor = 70);
CREATE INDEX shadow_bucket_hours_hour ON shadow_bucket_hours (hour);

CREATE TABLE shadow_bucket_days (
    service         TEXT NOT NULL,
    bucket          TEXT NOT NULL,
    -- a UTC day
    day             TIMESTAMPTZ NOT NULL,
    reports         BIGINT NOT NULL,
    enforce_reports BIGINT NOT NULL,
    offered         DOUBLE PRECISION NOT NULL,
    admitted        DOUBLE PRECISION NOT NULL,
    dropped         DOUBLE PRECISION NOT NULL,
    shadow_dropped  DOUBLE PRECISION NOT NULL,
    max_offered     DOUBLE PRECISION NOT NULL,
    max_drop_ratio  DOUBLE PRECISION NOT NULL,
    first_t         TIMESTAMPTZ NOT NULL,
    last_t          TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (service, bucket, day)
) WITH (fillfactor = 70);
CREATE INDEX shadow_bucket_days_day ON shadow_bucket_days (day);

-- The blocks stored so far keep counting in the overview.
INSERT INTO shadow_bucket_hours (service, bucket, hour, reports, enforce_reports, offered, admitted,
                                 dropped, shadow_dropped, max_offered, max_drop_ratio, first_t, last_t)
SELECT service, bucket, to_timestamp(floor(extract(epoch FROM block) / 3600) * 3600),
       SUM(reports), SUM(enforce_reports), SUM(offered), SUM(admitted), SUM(dropped),
       SUM(shadow_dropped), MAX(max_offered), MAX(max_drop_ratio), MIN(first_t), MAX(last_t)
FROM shadow_blocks
GROUP BY 1, 2, 3;

INSERT INTO shadow_bucket_days (service, bucket, day, reports, enforce_reports, offered, admitted,
                                dropped, shadow_dropped, max_offered, max_drop_ratio, first_t, last_t)
SELECT service, bucket, to_timestamp(floor(extract(epoch FROM block) / 86400) * 86400),
       SUM(reports), SUM(enforce_reports), SUM(offered), SUM(admitted), SUM(dropped),
       SUM(shadow_dropped), MAX(max_offered), MAX(max_drop_ratio), MIN(first_t), MAX(last_t)
FROM shadow_blocks
GROUP BY 1, 2, 3;
